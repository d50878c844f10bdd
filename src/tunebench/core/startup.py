"""A `tunebench` process's start-up and exit without the garbage collector's full walks, and its memory
kept for reuse.

Importing torch and transformers' GPT-2 leaves ~385,000 objects the collector tracks, and it walks them
again and again while they arrive, then once more when the interpreter exits. Measured on a 2-core CPU,
a 2-step pretraining command took 7.5-8.4 s with the collector as it is, 6.7-7.6 s with the exit's walk
skipped, and 6.5-7.4 s as done here. So the command (cli.entry) pauses collection; the first training
loop, or any other job once it starts, resumes it with what already exists frozen (modules, the model:
they live as long as the process, and later collections skip them); and exit skips the last walk. A
program that calls cli.main or the Python API keeps its collector as it was.

The command also keeps the memory it frees (`keep_freed_memory`). glibc hands large freed blocks back to the
OS (each over 32 MB is its own mapping; the heap's free top is trimmed), and a training step allocates the
same blocks again: the kernel faults in and zeroes every page anew, ~2.1 us a 4 KB page on a 2-core VM. So
the command starts its process with glibc's tunables set (GLIBC_TUNABLES, read only when a process starts:
it runs itself again once, ~40 ms): every block from the heap, the heap never trimmed, and the per-thread
cache held to chunks of 16 bytes. Without that last one, the small pieces glibc's aligned allocations leave
behind sit in that cache between free blocks, so a freed block is not merged and reused: one 64 MB tensor
made and freed 12 times peaked at 670 MB RSS (286 with the defaults), and the medium pretraining config at
5,139 MB against 4,509. With all three, on that VM: the 64 MB tensor 286 MB and reused from the second
round; pages faulted a step of SmolLM2 LoRA 62,000-92,000 -> 5 (peak RSS 1,909-1,915 against 1,985-2,015
MB); the medium config, one run each, 159 -> 178 tokens/s and a peak of 4,509 -> 4,265 MB. The heap shrinks
only where a new peak-memory window starts (`release_freed`: each probe, the training loop) and around the draw of a
step that samples (grpo/steps.py: kept across both phases' changing shapes, the heap grew in stairs), so a probe's
larger micro batch is not held through the run; the command's children inherit the setting. A program
calling the Python API keeps its process as it is; malloc settings a user put in GLIBC_TUNABLES are left
alone. PyTorch's CUDA allocator keeps GPU memory in the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import signal
import sys
import threading
import time

_paused = False
# Whether the user chose torch's compiler cache: read as the package loads (tunebench/__init__.py imports this
# module first), because torch writes its /tmp default into the environment the first time it looks
# (training/autotune/compiler.compile_blocks moves it next to ours).
USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ
# glibc's malloc tunables: no block mapped on its own, no trimming of the heap, the per-thread cache for
# chunks of up to 16 bytes only (see above). A process reads them once, as it starts.
KEEP_FREED = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_max=16"


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
    """Run this command again, once, with KEEP_FREED in GLIBC_TUNABLES (its children inherit it). Nothing
    happens off glibc, or where GLIBC_TUNABLES already names malloc settings (ours, or the user's)."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    if "glibc.malloc." in (tunables or "") or not on_glibc():
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{KEEP_FREED}" if tunables else KEEP_FREED
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:  # the interpreter cannot be started again: go on as this process is
        if tunables is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = tunables


def release_freed() -> None:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim). A new peak-memory window starts
    with it (metrics.reset_peak_memory): a probe or the run then holds and counts its own memory, not what
    a larger probe before it, or loading, left free in the heap."""
    if on_glibc():
        ctypes.CDLL(None).malloc_trim(0)


def on_glibc() -> bool:
    """Whether this process runs on glibc, whose malloc the tunables and malloc_trim above belong to."""
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # musl and others: no such name
        return False


def allocator() -> tuple[str, str]:
    """The settings row's value and reason: what this process's allocator does with freed memory."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if KEEP_FREED in tunables:
        return "reuse", ("freed memory serves the next step, not handed back to the OS and faulted in again page "
                         "by page (glibc tunables; see tunebench.core.startup)")
    if "glibc.malloc." in tunables:
        return "GLIBC_TUNABLES", "the malloc settings GLIBC_TUNABLES names, left as they are"
    return "C default", "freed memory goes back to the OS (the tunebench command keeps it)"


@functools.cache
def libc_prctl():
    """libc's prctl, or None where there is none. Looked up once: find_library runs `ldconfig -p` (a process of its
    own), which must not happen in a child between fork and exec, where die_with_parent runs as Popen's preexec_fn
    (children.start looks it up in the parent first, and the fork inherits the answer)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent: int, signum: int | None = None) -> bool:
    """Ask Linux to send this process `signum` (SIGTERM unless given) when its parent dies, even by kill -9 (a
    training process then checkpoints and stops; nothing keeps training for no one), and do it now if `parent` is
    already gone. Children of compare and tune call it before they run; torchrun's ranks, whose agent starts each
    in a session of its own that no process-group kill reaches, call it as they join the group; a GRPO
    environment's process (core/userprocess.py) asks for SIGKILL, which a call stuck in C cannot hold off. False
    where the system has no prctl (elsewhere than Linux: the parent's own `stop` still ends them)."""
    signum = signal.SIGTERM if signum is None else signum
    prctl = libc_prctl()
    if prctl is None:
        return False
    prctl(1, signum)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)
    return True


_handled = [False]  # whether a Python signal handler of this process has run (note_signal)
STUCK_S = 30.0  # how long after its parent died a process may go without running its handler (see watch_parent)
GRACE_S = 600.0  # how long after that it may take to checkpoint and stop


def note_signal() -> None:
    """Called by every Python signal handler of a run (training.stopping): the main thread runs Python again."""
    _handled[0] = True


def watch_parent(parent: int) -> None:
    """End this process if `parent` dies and it does not end on its own. die_with_parent's SIGTERM reaches Python's
    handler only between bytecodes of the main thread: a rank blocked in a collective whose peer is gone (gloo waits
    in C++) never runs it, and lived on with parent 1, holding its run directory, after its launcher was killed
    with kill -9. So a daemon thread (collectives release the GIL) watches the parent: once it is gone, a process
    whose handler has not run within STUCK_S seconds is stuck and is killed; one whose handler ran (it is saving a
    checkpoint and stopping) gets GRACE_S more. TUNEBENCH_STUCK_S sets the first."""
    stuck = float(os.environ.get("TUNEBENCH_STUCK_S", STUCK_S))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        deadline = time.monotonic() + stuck
        while not _handled[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        if _handled[0]:
            time.sleep(GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="tunebench-parent-watch").start()
