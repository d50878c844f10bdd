"""One writer per run directory: a training process holds an exclusive lock on its output directory for its
whole life, so a second start (a Resume clicked while the run still trains in a terminal, say) is refused
before it can delete the first one's checkpoint in flight. flock, not a pid file: the kernel drops the lock
when the process dies, however it dies, so a stale lock cannot outlive its run.

Also the one way to tell that a pid still names the process it was written for (pids are reused): its
start time, from /proc, stored beside the pid.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
from pathlib import Path

from tunebench.core.errors import TunebenchError

LOCK = ".tunebench.lock"
_held: dict[Path, int] = {}  # directory -> the open lock file's descriptor, for this process's life


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def alive(pid: int, start: int | None) -> bool:
    """The process `pid` is still the one that started at `start` (not a later process given the same pid)."""
    return start is not None and process_start(pid) == start


def hold(directory: Path) -> None:
    """Take the run directory's lock for the rest of this process (again in the same process: a no-op); another
    live process holding it is refused in one line that names it."""
    key = directory.resolve()
    if key in _held:
        return
    try:  # no-follow: a link planted in a shared run directory must not make us lock (and write) another file
        fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise TunebenchError(f"cannot take the lock {key / LOCK} ({e.strerror}); if it is a symbolic link, remove "
                             "it") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _read(fd)
        os.close(fd)
        raise TunebenchError(f"--output-dir '{directory}' is in use by another tunebench process"
                             f"{' (pid ' + str(who['pid']) + ')' if who.get('pid') else ''}; wait for it to end or "
                             "stop it first, or pick another --output-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "start": process_start(os.getpid())}).encode(), 0)
    _held[key] = fd


def release(directory: Path) -> None:
    fd = _held.pop(directory.resolve(), None)
    if fd is not None:
        os.close(fd)


def released(job):
    """A job function that lets go, however it ends, of every run directory lock it took: a run refused or
    failed after its directory opened must not keep it locked for the rest of a process that runs many (the
    Python API, tests)."""

    @functools.wraps(job)
    def run(*args, **kwargs):
        before = set(_held)
        try:
            return job(*args, **kwargs)
        finally:
            for key in set(_held) - before:
                release(key)

    return run


def holder(directory: Path) -> dict | None:
    """{pid, start} of the live process that holds the directory's lock; None when nobody does."""
    path = directory / LOCK
    if directory.resolve() in _held:
        return {"pid": os.getpid(), "start": process_start(os.getpid())}
    if not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {"pid": None}
    finally:
        os.close(fd)
    return None


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
