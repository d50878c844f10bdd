"""Atomic checkpoints (temp dir, then rename) and exact resume: weights, optimizer, schedule, RNG, data position.

Under several ranks the checkpoint is the same files: the trainable weights and optimizer state are
whole (DDP replicas agree; a sharded model's are gathered with torch.distributed.checkpoint's full
state dicts), the data position counts global micro-steps, and each rank's RNG state is gathered
into the one file. So a run saved by 2 ranks resumes on 1, or on 4, with the same global batches;
only a rank's RNG stream (dropout masks) is new where the world size changed.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core import durable, runlock
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.settings.rundir import RunDir
from tunebench.training.loop import LoopState

STATE = "state.json"
TENSORS = "training_state.pt"


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain numbers, so a checkpoint loads with weights_only=True
    (no pickled objects: a shared --resume directory cannot run code)."""
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(mt), gauss], "torch": torch.get_rng_state(),
           "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(s: dict[str, Any]) -> None:
    version, mt, gauss = s["python"]
    random.setstate((version, tuple(mt), gauss))
    n = s["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(root: Path, model, optimizer, scheduler, state: LoopState, identity: dict[str, Any], keep: int,
         scaler=None, world: World = World()) -> Path:
    """Write checkpoints/step-N atomically and keep the newest `keep`. Every rank calls it (gathering
    weights and RNG states are collectives); rank 0 writes."""
    final = root / f"step-{state.step:08d}"
    weights, optim_state = distributed.full_state(model, optimizer, world)
    rngs = distributed.gather(world, _rng_state())
    if world.main:
        with durable.atomic_dir(final) as tmp:  # flushed to disk before the rename, and the rename too
            torch.save(
                {
                    "trainable": weights,
                    "optimizer": optim_state,
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler else None,
                    "rng": rngs,  # one per rank
                },
                tmp / TENSORS,
            )
            (tmp / STATE).write_text(json.dumps({"loop": state.to_dict(), "identity": identity,
                                                 "world_size": world.size}, indent=1))
        rotate(root, final, keep)  # only once the new one is durable
    distributed.barrier(world)  # no rank runs ahead of a checkpoint that is not yet on disk
    return final


def rotate(root: Path, newest: Path, keep: int) -> None:
    """Keep the `keep` newest checkpoints that load, counting back from `newest` (just written). A damaged
    one is not counted, and so cannot crowd out the good ones; one from a later step than `newest` (what an
    earlier run left after a checkpoint that this run skipped as damaged) is not this rotation's to judge and
    stays. The checkpoint a run resumed from goes only once `keep` newer good ones are on disk."""
    good = 0
    for path in reversed([p for p in list_checkpoints(root) if p.name <= newest.name]):
        if good < keep and (path == newest or verified(path)):
            good += 1
        else:
            shutil.rmtree(path, ignore_errors=True)


_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) of checkpoints whose checksums passed


def verified(path: Path) -> bool:
    """damaged(path) is None, remembered per file so that each save does not reread the kept checkpoints."""
    try:
        stat = (path / TENSORS).stat()
    except OSError:
        return False
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED and damaged(path) is None:
        _VERIFIED.add(key)
    return key in _VERIFIED


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE).is_file() and (p / TENSORS).is_file()]
    return sorted(done, key=lambda p: p.name)


def find(resume: str, root: Path) -> Path | None:
    """The checkpoint `--resume` names: `auto` -> the newest under root that loads (None if there is
    none); a newer one that does not (a power loss mid-write, a truncated file) is skipped, and said so."""
    if resume == "auto":
        for path in reversed(list_checkpoints(root)):
            problem = damaged(path)
            if problem is None:
                return path
            print(f"resume: skipping {path.name}: {problem}")
        return None
    path = Path(resume)
    if not (path / STATE).is_file() or not (path / TENSORS).is_file():
        raise TunebenchError(f"--resume '{resume}' is not a tunebench checkpoint directory (no {STATE} and "
                             f"{TENSORS}); name a checkpoints/step-N directory or use --resume auto")
    problem = damaged(path)
    if problem:
        raise TunebenchError(f"--resume '{resume}': {problem}; name an older checkpoint or use --resume auto")
    return path


def damaged(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: its state file must parse and its tensor file
    (a zip archive) must pass its checksums. Reads the files, loads nothing."""
    try:
        json.loads((path / STATE).read_text())["loop"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {STATE} is unreadable"
    try:
        with zipfile.ZipFile(path / TENSORS) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile):
        return f"its {TENSORS} is truncated or not a checkpoint"
    return f"its {TENSORS} fails its checksum ({bad})" if bad else None


def clean_stale(root: Path) -> None:
    """Remove half-written checkpoints (.tmp-*) that a process killed mid-save left behind."""
    for p in durable.clean_stale(root):
        print(f"checkpoints: removed {p.name}, left by a save that never finished")


def check_identity(path: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's metadata, once the settings in `identity` are those it was made with."""
    try:
        meta = json.loads((path / STATE).read_text())
        made_with = meta["identity"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TunebenchError(f"checkpoint {path} has an unreadable {STATE} ({e}); resume from another "
                             "checkpoint or start a new --output-dir") from e
    changed = sorted(k for k in identity if not _same(k, made_with.get(k), identity[k]))
    if changed:
        said = ", ".join(_what_changed(k, made_with.get(k), identity[k]) for k in changed)
        raise TunebenchError(f"checkpoint {path} was made with different {said}; resume with the same settings or "
                             "start a new --output-dir")
    return meta


def _what_changed(key: str, then: Any, now: Any) -> str:
    """`key`, and for a section (the adapter's settings) each of its settings that differs, then and now: a
    setting an identity leaves out is one added later, at the value the runs before it had (finetune_model.identity)."""
    if not (isinstance(then, dict) and isinstance(now, dict)):
        return key

    def value(d: dict, k: str) -> Any:
        return d[k] if k in d else "unrecorded (as before the setting)"

    said = [f"{k}: {value(then, k)} then, {value(now, k)} now" for k in sorted(set(then) | set(now))
            if then.get(k) != now.get(k)]
    return f"{key} ({'; '.join(said)})"


NAMED = ("model", "data")  # identity entries that may be paths: a relative one and its absolute form are the same


def _same(key: str, before: Any, now: Any) -> bool:
    """Whether a checkpoint's `before` and this run's `now` are one setting. A path is the same where one run typed it
    relative and the other holds it absolute and ending in it: a run started before children moved to their run
    folder (jobs/children.py) kept `d.jsonl`, its resume from the studio or compare names the same file whole."""
    if before == now or key not in NAMED:
        return before == now

    def tail_of(a: Any, b: Any) -> bool:
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(tail_of(x, y) for x, y in zip(a, b))
        if not (isinstance(a, str) and isinstance(b, str)) or os.path.isabs(a) == os.path.isabs(b):
            return a == b
        whole, typed = (Path(a), Path(b)) if os.path.isabs(a) else (Path(b), Path(a))
        parts = Path(os.path.normpath(typed)).parts
        return ".." not in parts and whole.parts[-len(parts):] == parts

    return tail_of(before, now)


def check_before_resume(out: str | Path, resume: str, identity: dict[str, Any]) -> None:
    """The checkpoint a resume would continue from, checked against `identity` before the run opens: for what
    must be refused before it runs at all (a reward file that changed since would run on import)."""
    found = find(resume, RunDir(Path(out)).checkpoints)
    if found is not None:
        check_identity(found, identity)


USER_CODE = "user_code.json"  # the user's files a run executes (rewards, environment): resolved path -> sha256


def check_user_code(out: str | Path, resume: str | None, code: dict[str, str]) -> None:
    """A resume (with a checkpoint found or not) brings the files its run's first start recorded, unchanged and
    from the same place: before any runs. `code` is {path: sha256}; paths are compared resolved, so a relative
    `env.py` given from another folder (a studio started elsewhere) is another file."""
    record = Path(out) / USER_CODE
    if not resume or not record.is_file():
        return
    now = _resolved(code)
    then = json.loads(record.read_text())
    if now != then:
        changed = next((p for p, h in now.items() if then.get(p) != h), None) or sorted(set(then) - set(now))[0]
        raise TunebenchError(f"--resume: {changed} is not the file this run started with (its path or its bytes "
                             f"differ from {record}); give the same files, or start a new --output-dir")


def record_user_code(out: Path, resume: str | None, code: dict[str, str]) -> None:
    """Write USER_CODE at a run's first start (a resume keeps the record it was checked against)."""
    if code and not (resume and (out / USER_CODE).is_file()):
        write_json(out / USER_CODE, _resolved(code))


def _resolved(code: dict[str, str]) -> dict[str, str]:
    return {str(Path(p).resolve()): h for p, h in code.items()}


def load(path: Path, model, optimizer, scheduler, identity: dict[str, Any], scaler=None,
         world: World = World()) -> LoopState:
    """Restore a checkpoint into a freshly built run, on every rank. The schedule is the new run's (its
    length and peak learning rate), at the checkpoint's step: resuming with a larger --max-steps trains
    on at the new schedule's rate, not at the rate the old schedule ended on (0 after a finished cosine)."""
    meta = check_identity(path, identity)
    try:
        blob = torch.load(path / TENSORS, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TunebenchError(f"checkpoint {path} holds pickled Python objects, which could run code when loaded; "
                             "tunebench refuses it (its own checkpoints hold tensors and numbers only): resume from "
                             "a checkpoint you made, or start a new --output-dir") from None
    distributed.load_full_state(model, optimizer, blob["trainable"], blob["optimizer"], world)
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(blob["scheduler"])  # the step count; the schedule's shape stays the new run's
    scheduler.base_lrs = base_lrs
    scheduler.last_epoch -= 1
    scheduler.step()  # sets each group's lr to the new schedule's value at this step
    if scaler is not None and blob["scaler"]:
        scaler.load_state_dict(blob["scaler"])
    rngs = blob["rng"] if isinstance(blob["rng"], list) else [blob["rng"]]
    if len(rngs) == world.size:
        _set_rng_state(rngs[world.rank])
    elif world.main:
        print(f"resume: the checkpoint was saved by {len(rngs)} rank(s), this run has {world.size}: each rank's "
              "random stream (dropout masks) starts afresh; data order and weights continue exactly")
    return LoopState(**meta["loop"])


# -- the output directory and the checkpoint a run resumes from, decided before anything expensive
def prepare_output_dir(path: Path, resume: str | None, overwrite: bool) -> None:
    """Check the output directory is writable, and never silently replace an earlier run in it."""
    if resume and not path.exists():  # a mistyped --output-dir: said, not a silent step 0
        print(f"resume: --output-dir '{path}' does not exist, so it holds no checkpoint to continue from; starting a "
              f"new run there from step 0 (check the path if you meant to continue a run)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a new file of a unique name (O_EXCL): a link planted in the directory is never written through
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TunebenchError(f"cannot write to --output-dir '{path}' ({e.strerror}); pick a writable directory") from e
    runlock.hold(path)  # before anything below deletes: a second process must not touch a live run's files
    run = RunDir(path)
    if run.checkpoints.is_symlink():  # saves, rotation, clean-up and --overwrite delete inside it: never elsewhere
        raise TunebenchError(f"'{run.checkpoints}' is a symbolic link; tunebench writes, rotates and deletes a run's "
                             "checkpoints only in a folder of its own inside --output-dir: remove the link (to keep "
                             "checkpoints on another disk, give an --output-dir there)")
    clean_stale(run.checkpoints)
    durable.clean_stale(path)  # a final save (durable.atomic_files) killed before its files moved into place
    earlier = [p for p in (run.checkpoints, run.metrics_file, run.summary_file) if p.exists()]
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
        found = resume_point(resume, out, identity, overwrite)
        record_user_code(out, resume, identity.get("reward_files") or {})  # a GRPO run's files, at its first start
        return found

    return distributed.agree(world, check)


def resume_point(resume: str | None, out: Path, identity: dict[str, Any], overwrite: bool = False) -> Path | None:
    """The checkpoint to continue from, checked before anything expensive: a path that is not a checkpoint,
    or one made with other settings (`identity`: those known before the model loads), is refused here;
    with `resume: auto` and `overwrite` both asked, a checkpoint of other settings is replaced instead (the
    run starts over, as overwrite says)."""
    if not resume:
        return None
    found = find(resume, RunDir(out).checkpoints)
    if found is None:
        print(f"resume: no checkpoint under {RunDir(out).checkpoints}; starting from step 0")
        return None
    try:
        check_identity(found, identity)
    except TunebenchError:
        if not (overwrite and resume == "auto"):
            raise
        print(f"resume: {found.name} was made with other settings; starting over, as --overwrite asks")
        prepare_output_dir(out, None, True)
        return None
    return found
