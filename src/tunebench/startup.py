"""A `tunebench` process's start-up and exit without the garbage collector's full walks.

Importing torch and transformers' GPT-2 leaves ~385,000 objects the collector tracks, and it walks them
again and again while they arrive, then once more when the interpreter exits. Measured on a 2-core CPU,
a 2-step pretraining command took 7.5-8.4 s with the collector as it is, 6.7-7.6 s with the exit's walk
skipped, and 6.5-7.4 s as done here. So the command (cli.entry) pauses collection; the first training
loop, or any other job once it starts, resumes it with what already exists frozen (modules, the model:
they live as long as the process, and later collections skip them); and exit skips the last walk. A
program that calls cli.main or the Python API keeps its collector as it was.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    global _paused
    _paused = gc.isenabled()
    gc.disable()


def done() -> None:
    """Start-up is over: resume collection if `pause` stopped it (once; later calls do nothing)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def before_exit() -> None:
    """Nothing of the process outlives it: the interpreter's final collection need not walk what exists."""
    gc.freeze()
