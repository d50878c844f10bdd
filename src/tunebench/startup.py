"""A `tunebench` process's start-up and exit without the garbage collector's full walks, and its memory
kept for reuse.

Importing torch and transformers' GPT-2 leaves ~385,000 objects the collector tracks, and it walks them
again and again while they arrive, then once more when the interpreter exits. Measured on a 2-core CPU,
a 2-step pretraining command took 7.5-8.4 s with the collector as it is, 6.7-7.6 s with the exit's walk
skipped, and 6.5-7.4 s as done here. So the command (cli.entry) pauses collection; the first training
loop, or any other job once it starts, resumes it with what already exists frozen (modules, the model:
they live as long as the process, and later collections skip them); and exit skips the last walk. A
program that calls cli.main or the Python API keeps its collector as it was.

The command also keeps the memory it frees (`keep_freed_memory`). glibc hands large freed blocks back to
the OS (each over 32 MB is its own mapping; the heap's free top is trimmed), and a training step allocates
the same blocks again: the kernel faults in and zeroes every page anew, ~2.1 us a 4 KB page on a 2-core
VM. Measured there, pages faulted a step with glibc's defaults and kept: SmolLM2 LoRA (4 x 128 tokens,
two micro-batches) 62,000-92,000 and 1,000-6,000; the medium pretraining config ~175,000 and 0-30,000;
the 4 x 128 shakespeare_char model 770-830 and ~1. Peak RSS stayed within the runs' spread (LoRA
1,885-2,051 against 1,964-2,023 MB; medium 4,004-4,163 against 4,057-4,078). The cost: the heap never
shrinks, and a block freed and asked for again at once can take a few rounds to be reused (glibc's
aligned allocations leave small pieces in its per-thread cache that keep free blocks apart): one 64 MB
tensor made and freed 12 times peaked at 670 MB RSS, against 286 with the defaults. PyTorch's CUDA
allocator keeps GPU memory in the same way; on a CPU the C library's settings do it (nothing to install).
"""

from __future__ import annotations

import ctypes
import gc
import sys

_paused = False
_allocator = ("C default", "freed memory goes back to the OS (the tunebench command keeps it)")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


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


def keep_freed_memory() -> None:
    """glibc: every block from the heap (no per-block mappings) and the heap never trimmed (mallopt(3):
    M_MMAP_MAX 0, M_TRIM_THRESHOLD -1), so freed memory is reused rather than faulted in again."""
    global _allocator
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library; musl has no mallopt
    except (OSError, AttributeError):
        return
    if mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, -1) == 1:
        _allocator = ("reuse", "freed memory serves the next step, not handed back to the OS and faulted in "
                               "again page by page (glibc mallopt; see tunebench.startup)")


def allocator() -> tuple[str, str]:
    """The settings row's value and reason: what this process's allocator does with freed memory."""
    return _allocator
