"""Writes that survive a kill and a power loss: a temp file or directory beside the target, flushed to
disk (fsync), given the user's umask (mkstemp would leave it 0600), renamed over the target, and the
directory entry flushed too. Without the fsyncs, a rename can reach the disk before the data it names,
and a power loss leaves an empty `step-N` where a checkpoint was."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tunebench.core.errors import TunebenchError


def open_no_follow(path: str | Path, mode: str = "w", encoding: str | None = "utf-8", newline: str | None = None):
    """open(path, mode) for "w", "wb", "a" or "ab", refusing a symbolic link where the file goes: a run
    directory is shared (the studio's runs, a team's disk), and a link planted there must not turn a write of
    ours into a write of some other file of the user's. Raises TunebenchError naming the link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)  # the umask applies, as open()'s does
    except OSError:
        if Path(path).is_symlink():
            raise TunebenchError(f"'{path}' is a symbolic link; tunebench writes there only to a plain file: remove "
                                 "the link") from None
        raise
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding, newline=newline)


def umask_mode(directory: bool = False) -> int:
    """The mode a plain open()/mkdir() would give under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temp path beside `path`; once the block ends without error it is flushed, given the
    umask's mode and renamed over `path`. On an error (or Ctrl-C) the temp file is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, umask_mode())
        fsync_path(tmp)
        os.replace(tmp, p)
        fsync_path(p.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path, prefix: str = ".tmp-") -> Iterator[Path]:
    """The same for a directory (a checkpoint): every file in it and the directory itself flushed before
    the rename; a directory already at `path` is replaced. Replacing is two renames (the old one aside as
    `.old-NAME`, the new one into place), never a deletion before the rename: a kill between them leaves the
    old directory whole under its aside name, and clean_stale puts it back."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=p.parent, prefix=prefix))
    try:
        yield tmp
        os.chmod(tmp, umask_mode(directory=True))
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, umask_mode())
                fsync_path(f)
        fsync_path(tmp)
        aside = p.parent / f"{OLD}{p.name}"
        if p.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(p, aside)
        os.replace(tmp, p)
        fsync_path(p.parent)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(directory: str | Path, prefix: str = ".tmp-") -> Iterator[Path]:
    """Yield a temp directory inside `directory` (a run's, which holds other files); once the block ends without
    error each file written there is flushed and renamed into `directory`, replacing its old copy: a kill
    leaves every file old or new, never half written. On an error nothing is moved."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=prefix))
    try:
        yield tmp
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                os.chmod(f, umask_mode())
                fsync_path(f)
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                (out / f.relative_to(tmp)).parent.mkdir(parents=True, exist_ok=True)
                os.replace(f, out / f.relative_to(tmp))
        fsync_path(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def landing(tmp: Path, out: Path) -> list[Path]:
    """Where the files written so far in atomic_files' temp directory `tmp` will land in `out`."""
    return [out / f.relative_to(tmp) for f in sorted(tmp.rglob("*")) if f.is_file()]


OLD = ".old-"  # a directory atomic_dir set aside while replacing it


def clean_stale(directory: str | Path, prefix: str = ".tmp-") -> list[Path]:
    """Remove what a process killed mid-write left behind (temp files or directories named `prefix*`), and put
    back a directory atomic_dir had set aside when the kill came before its replacement was in place."""
    removed = []
    for aside in Path(directory).glob(f"{OLD}*") if Path(directory).is_dir() else []:
        target = aside.parent / aside.name[len(OLD):]
        if target.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, target)
    for p in Path(directory).glob(f"{prefix}*") if Path(directory).is_dir() else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def repair_tail(path: str | Path) -> bool:
    """Cut a line-oriented file (CSV, JSONL) back to its last newline, so an append after a torn write
    starts a row of its own instead of gluing onto half a row. True when something was cut."""
    p = Path(path)
    if p.is_symlink():  # a planted link: cutting "its" tail would cut the file it points at

        raise TunebenchError(f"'{path}' is a symbolic link; tunebench writes there only to a plain file: remove the "
                             "link")
    if not p.is_file() or p.stat().st_size == 0:
        return False
    with os.fdopen(os.open(p, os.O_RDWR | os.O_NOFOLLOW), "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return False
        # find the last newline, reading backwards in blocks
        end, keep = size, 0
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            at = block.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return True
