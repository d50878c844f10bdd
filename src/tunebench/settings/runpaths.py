"""A run's configuration with every path it names made absolute against a folder: what a child run needs when it
starts in its own run folder (jobs/children.py) rather than the folder its parent was started from, where a
relative path would name something else.

The keys that hold paths are listed here, by how they hold them. A value that may be a path or a name (a model
preset or hub id, `builtin:` data, a reward such as `gsm8k`) is made absolute only where the folder holds it; an
output folder is made absolute whether or not it exists yet.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunebench.settings.finetune import MODEL_PRESETS

ALWAYS = ("output.output_dir", "logging.logging_dir", "data.cache_dir")  # written to, so maybe not there yet
WHERE_THERE = ("model.name", "model.tokenizer", "data.path", "data.tokenizer", "data.validation_file",
               "objective.environment")  # a path, or a name where no such path is there


def absolute(text: str | None, base: Path, always: bool = False) -> str | None:
    """`text` as a path under `base` where it is relative and (unless `always`) `base` holds it, or holds the part
    before its last ':' (`rewards.py:score`); else `text` unchanged."""
    if not text or os.path.isabs(text):
        return text
    if always or (base / text).exists():
        return os.path.normpath(base / text)
    head, sep, tail = text.rpartition(":")
    if sep and head and not os.path.isabs(head) and (base / head).exists():
        return f"{os.path.normpath(base / head)}:{tail}"
    return text


def _resume(text: str | None, base: Path) -> str | None:
    return text if text in (None, "auto") else absolute(text, base, always=True)


def _comma_listed(text: str | None, base: Path) -> str | None:
    return ",".join(absolute(p.strip(), base) for p in text.split(",")) if text else text


def _sources(pairs: tuple[tuple[str, float], ...], base: Path) -> tuple[tuple[str, float], ...]:
    return tuple((absolute(p, base), w) for p, w in pairs)


def _each(items: tuple[str, ...], base: Path) -> tuple[str, ...]:
    return tuple(absolute(i, base) for i in items)


SHAPED: dict[str, Callable[[Any, Path], Any]] = {"output.resume": _resume, "data.train_file": _comma_listed,
                                                 "data.sources": _sources, "objective.reward": _each}


def with_absolute_paths(cfg: Any, base: Path) -> Any:
    """`cfg` (a RunConfig or PretrainRun) with the paths of ALWAYS, WHERE_THERE and SHAPED made absolute against
    `base`; each section that has none of those keys is kept as it is."""
    changed = {}
    for section in (f.name for f in dataclasses.fields(cfg)):
        value = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else set()
        new = {}
        for name in names:
            key = f"{section}.{name}"
            if key == "model.name" and getattr(value, name) in MODEL_PRESETS:
                continue  # a preset is a preset wherever the run starts, a folder of its name or not
            if key in ALWAYS or key in WHERE_THERE:
                new[name] = absolute(getattr(value, name), base, always=key in ALWAYS)
            elif key in SHAPED:
                new[name] = SHAPED[key](getattr(value, name), base)
        new = {k: v for k, v in new.items() if v != getattr(value, k)}
        if new:
            changed[section] = dataclasses.replace(value, **new)
    return dataclasses.replace(cfg, **changed) if changed else cfg
