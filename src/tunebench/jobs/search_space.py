"""`tunebench tune`'s search space: a YAML of `key: [a, b, c]` (a choice) or `key: {low, high[, log][, step]}` (a
range), read into Optuna's suggestions (Param), and every choice checked as a valid run before a trial starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.jobs import compare
from tunebench.settings.finetune import read_yaml, shipped_yaml

SPACES_DIR = Path(__file__).resolve().parents[1] / "configs" / "tune"


@dataclass(frozen=True)
class Param:
    key: str
    choices: tuple | None = None  # a list in the space: categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    integer: bool = False

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def corners(self) -> list[Any]:
        """Values that every choice of this parameter's range is checked with before anything runs."""
        if self.choices is not None:
            return list(self.choices)
        return [int(self.low), int(self.high)] if self.integer else [self.low, self.high]


def space_path(spec: str) -> Path:
    return shipped_yaml(spec, SPACES_DIR, "search space")


def load_space(spec: str) -> list[Param]:
    """`key: [a, b, c]` (a choice) or `key: {low, high[, log][, step]}` (a range; whole numbers make it an int range)."""
    raw = read_yaml(space_path(spec))
    if not raw:
        raise TunebenchError(f"search space '{spec}' names no options; add e.g. 'train.lr: {{low: 1e-5, high: 1e-3, log: true}}'")
    params = []
    for key, value in raw.items():
        if isinstance(value, list):
            if not value or any(isinstance(v, (list, dict)) for v in value):
                raise TunebenchError(f"search space '{spec}': '{key}' needs a list of plain values, got {value!r}")
            params.append(Param(str(key), choices=tuple(value)))
            continue
        if not isinstance(value, dict) or not {"low", "high"} <= set(value):
            raise TunebenchError(f"search space '{spec}': '{key}' must be a list of values or "
                                 "{low: ..., high: ...[, log: true][, step: ...]}")
        extra = set(value) - {"low", "high", "log", "step"}
        if extra:
            raise TunebenchError(f"search space '{spec}': '{key}' has unknown field(s) {', '.join(sorted(extra))}; "
                                 "use low, high, log, step")
        try:
            low, high = float(value["low"]), float(value["high"])
            step = float(value["step"]) if value.get("step") is not None else None
        except (TypeError, ValueError) as e:
            raise TunebenchError(f"search space '{spec}': '{key}' needs numbers for low, high and step") from e
        log = value.get("log", False)
        if not isinstance(log, bool):
            raise TunebenchError(f"search space '{spec}': '{key}' log must be true or false, got {log!r}")
        if not (math.isfinite(low) and math.isfinite(high)):
            raise TunebenchError(f"search space '{spec}': '{key}' needs finite low and high, got {low:g} and {high:g}")
        if step is not None and (log or not math.isfinite(step) or step <= 0):
            raise TunebenchError(f"search space '{spec}': '{key}' " + (
                "cannot have both step and log: Optuna samples a log range continuously; drop one" if log
                else f"step must be a positive finite number, got {step:g}"))
        if not low < high:
            raise TunebenchError(f"search space '{spec}': '{key}' needs low < high, got {low:g} and {high:g}")
        if log and low <= 0:
            raise TunebenchError(f"search space '{spec}': '{key}' is log-scaled, so low must be above 0")
        integer = all(isinstance(value.get(k), int) and not isinstance(value.get(k), bool)
                      for k in ("low", "high") + (("step",) if step is not None else ()))
        params.append(Param(str(key), low=low, high=high, log=log, step=step, integer=integer))
    return params


def check(job: str, config: str | None, base: dict[str, Any], params: list[Param]) -> None:
    """Every parameter's every choice (each range's ends) is a valid run with the base settings,
    checked here, before a trial starts."""
    base = compare.canonical(job, base)
    keys = set(base)
    for p in params:
        if set(compare.canonical(job, {p.key: p.corners()[0]})) & keys:
            raise TunebenchError(f"'{p.key}' is both searched and set (by tune itself or on the command line); "
                                 "drop one of them")
        for value in p.corners():
            try:
                cfg = compare.load_job_config(job, config, {**base, **compare.canonical(job, {p.key: value})})
            except TunebenchError as e:
                raise TunebenchError(f"search space: {p.key}={value!r} is not a valid run: {e}") from e
    cfg = compare.load_job_config(job, config, base)
    if job == "train" and cfg.data.eval_fraction == 0:
        raise TunebenchError("tune judges trials by their eval loss, and data.eval_fraction is 0; hold some rows out "
                             "(e.g. data.eval_fraction=0.05)")
