"""Measured decisions shared by every training job: micro batch, attention kernel, compile, layout.

Each decision is measured on the real model (or reused from one cache of measurements, keyed by
a `Shape` of the run) and returned as a settings row (setting, value, reason). The jobs call
them in the same order: attention kernel, then micro batch, then compile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunebench.core.jsonfile import read_json, update_json
from tunebench.core.paths import cache_dir


@dataclass(frozen=True)
class Key:
    """One entry of the measurement cache: what was measured or learned (`kind`: batch, attention, compile, trained,
    steps, ...) and what it holds for (`fields`, by name). Built and narrowed by field, never by formatting or
    splitting text; the file holds each as `kind|{the fields as sorted JSON}`, the text it held before keys were
    typed, so a cache written earlier is read as it was."""

    kind: str
    fields: Mapping[str, Any]

    def text(self) -> str:
        return f"{self.kind}|" + json.dumps(dict(self.fields), sort_keys=True, default=str)

    def as_kind(self, kind: str) -> Key:
        """The same fields under another kind (what runs of a measured shape trained, say)."""
        return Key(kind, self.fields)

    def narrowed(self, kind: str, names: tuple[str, ...]) -> Key:
        """Only the fields `names` (None where absent) under `kind`: what holds for every shape on a machine, say."""
        return Key(kind, {name: self.fields.get(name) for name in names})


@dataclass(frozen=True)
class Shape:
    """What a measurement depends on. Two runs with equal shapes share every cached measurement;
    a change of any field (model, method, length, device, kernel, ...) measures again."""

    model: str  # a model spec, or an architecture's fingerprint for a model built from a config
    method: str  # lora | qlora | full | pretrain; "+dpo" / "+orpo" for a preference objective (a unit is a pair)
    quantization: str
    r: int | None
    target_modules: str | None
    max_length: int
    where: str  # the GPU's name, or the CPU model and thread count
    precision: str
    torch: str
    attention: str  # the kernel asked for (auto, or a named one)
    liger: str
    gradient_checkpointing: str

    def key(self, kind: str, **extra: Any) -> Key:
        return Key(kind, {**asdict(self), **extra})


@dataclass(frozen=True)
class Trained:
    """What is trained, as the measurement cache keys it: the first five fields of a Shape, which the job knows
    (runplan.Units.what); measuring.decide adds the machine's and the kernels' with `shape`."""

    model: str
    method: str  # with the objective where a step differs: "lora+dpo", "lora+grpo8x256+episodes4"
    quantization: str
    r: int | None  # or prompt tuning's virtual tokens
    target_modules: str | None

    def shape(self, **machine: Any) -> Shape:
        """The Shape of this run on a machine (max_length, where, precision, torch, attention, liger,
        gradient_checkpointing, by name)."""
        return Shape(**asdict(self), **machine)


def where(hw, plan, device) -> str:
    """The machine a measurement holds for: the GPU, or the CPU at this run's thread count."""
    return hw.gpus[0].name if device.type == "cuda" else f"{hw.cpu_model} x{plan.threads}"


def cache_file() -> Path:
    return cache_dir() / "autotune.json"


def cached(key: Key) -> dict | None:
    return read_json(cache_file()).get(key.text())


def store(key: Key, value: dict) -> None:
    update_json(cache_file(), key.text(), value)
