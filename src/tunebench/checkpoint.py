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
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import distributed
from tunebench.distributed import World
from tunebench.errors import TunebenchError
from tunebench.loop import LoopState

STATE = "state.json"
TENSORS = "training_state.pt"


def _rng_state() -> dict[str, Any]:
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
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
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        try:
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
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier(world)  # no rank runs ahead of a checkpoint that is not yet on disk
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE).is_file() and (p / TENSORS).is_file()]
    return sorted(done, key=lambda p: p.name)


def find(resume: str, root: Path) -> Path | None:
    """The checkpoint `--resume` names: `auto` -> the newest under root (None if there is none)."""
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE).is_file() or not (path / TENSORS).is_file():
        raise TunebenchError(f"--resume '{resume}' is not a tunebench checkpoint directory (no {STATE} and "
                             f"{TENSORS}); name a checkpoints/step-N directory or use --resume auto")
    return path


def check_identity(path: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's metadata, once the settings in `identity` are those it was made with."""
    try:
        meta = json.loads((path / STATE).read_text())
        made_with = meta["identity"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TunebenchError(f"checkpoint {path} has an unreadable {STATE} ({e}); resume from another "
                             "checkpoint or start a new --output-dir") from e
    changed = sorted(k for k in identity if made_with.get(k) != identity[k])
    if changed:
        raise TunebenchError(
            f"checkpoint {path} was made with different {', '.join(changed)}; resume with the same settings "
            "or start a new --output-dir"
        )
    return meta


def load(path: Path, model, optimizer, scheduler, identity: dict[str, Any], scaler=None,
         world: World = World()) -> LoopState:
    """Restore a checkpoint into a freshly built run, on every rank. The schedule is the new run's (its
    length and peak learning rate), at the checkpoint's step: resuming with a larger --max-steps trains
    on at the new schedule's rate, not at the rate the old schedule ended on (0 after a finished cosine)."""
    meta = check_identity(path, identity)
    blob = torch.load(path / TENSORS, map_location="cpu", weights_only=False)
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
