"""Measured decisions shared by every training job: micro batch, attention kernel, compile, layout.

Each decision is measured on the real model (or reused from one cache of measurements, keyed by
a `Shape` of the run) and returned as a settings row (setting, value, reason). The jobs call
them in the same order: attention kernel, then micro batch, then compile.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunebench.core.jsonfile import read_json, update_json
from tunebench.core.paths import cache_dir


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

    def key(self, kind: str, **extra: Any) -> str:
        return f"{kind}|" + json.dumps({**asdict(self), **extra}, sort_keys=True, default=str)


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


def cached(key: str) -> dict | None:
    return read_json(cache_file()).get(key)


def store(key: str, value: dict) -> None:
    update_json(cache_file(), key, value)
