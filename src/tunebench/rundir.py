"""A run's output directory and where it resumes from, decided before anything expensive: an earlier
run is never silently replaced, a checkpoint made with other settings is refused."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tunebench import checkpoint, distributed
from tunebench.distributed import World
from tunebench.errors import TunebenchError


def prepare_output_dir(path: Path, resume: str | None, overwrite: bool) -> None:
    """Check the output directory is writable, and never silently replace an earlier run in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TunebenchError(f"cannot write to --output-dir '{path}' ({e.strerror}); pick a writable directory") from e
    checkpoint.clean_stale(path / "checkpoints")
    earlier = [p for p in (path / "checkpoints", path / "metrics.jsonl", path / "summary.json") if p.exists()]
    if not earlier or resume:
        return
    if not overwrite:
        raise TunebenchError(
            f"--output-dir '{path}' already holds a run ({earlier[0].name}); continue it with --resume auto, "
            "replace it with --overwrite, or pick another --output-dir"
        )
    for p in earlier:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def open_run(world: World, out: Path, resume: str | None, overwrite: bool, identity: dict[str, Any]) -> Path | None:
    """prepare_output_dir and resume_point, on rank 0 only (the others must not delete or create the same
    files); every rank gets the checkpoint to resume from, or the same refusal."""
    def check() -> Path | None:
        prepare_output_dir(out, resume, overwrite)
        return resume_point(resume, out, identity)

    return distributed.agree(world, check)


def resume_point(resume: str | None, out: Path, identity: dict[str, Any]) -> Path | None:
    """The checkpoint to continue from, checked before anything expensive: a path that is not a checkpoint,
    or one made with other settings (`identity`: those known before the model loads), is refused here."""
    if not resume:
        return None
    found = checkpoint.find(resume, out / "checkpoints")
    if found is None:
        print(f"resume: no checkpoint under {out / 'checkpoints'}; starting from step 0")
        return None
    checkpoint.check_identity(found, identity)
    return found
