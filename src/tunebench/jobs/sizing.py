"""How much data a comparison uses when its matrix gives a time budget instead of a row count.

`./run compare` is the first thing a newcomer runs, on whatever machine they have: a fixed row count
takes two minutes on one machine and twenty on another. A matrix with `budget: {train_seconds: N}`
instead measures this machine now (a few training steps of the matrix's own model, method and data
at micro batch 1, the slowest configuration of the study) and gives every run the rows that fit its
share of N seconds. The figure is written beside the results, so an interrupted comparison resumes
with the rows it started with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.machine import hardware
from tunebench.settings.finetune import load_config

MIN_STEPS = 4  # fewer optimizer steps than this measure start-up, not training


@dataclass(frozen=True)
class Sizing:
    max_samples: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"max_samples": self.max_samples, "reason": self.reason}


def budget_seconds(raw: Any, spec: str) -> float | None:
    """The matrix's `budget: {train_seconds: N}`, checked; None when it has none."""
    if raw is None:
        return None
    seconds = raw.get("train_seconds") if isinstance(raw, dict) and set(raw) == {"train_seconds"} else None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise TunebenchError(f"matrix {spec}: budget must be {{train_seconds: N}} with N above 0 (the training time "
                             f"of all its runs on this machine), got {raw!r}")
    return float(seconds)


def size(settings: dict[str, Any], budget_s: float, runs: int, device: str, record: Path) -> Sizing:
    """data.max_samples for `runs` runs of `settings` sharing `budget_s` seconds of training on `device`.
    Reuses `record` (beside the results) when an earlier, interrupted comparison wrote it."""
    if record.is_file():
        kept = json.loads(record.read_text())
        return Sizing(int(kept["max_samples"]), kept["reason"] + " (as when these results began)")
    seconds_per_row, mean_tokens, available = measure_row(settings, device)

    cfg = load_config(options=settings)
    effective = cfg.effective_batch_size
    rows = int(budget_s / runs / seconds_per_row)
    floor = MIN_STEPS * effective
    train_rows = max(floor, rows // effective * effective)
    # The held-out rows come out of max_samples: ask for enough that train_rows are left to train on.
    max_samples = math.ceil(train_rows / (1 - cfg.data.eval_fraction))
    if max_samples >= available:
        max_samples = available
        why_all = f"; all {available} rows of the data fit"
    else:
        why_all = ""
    why = (f"the matrix's budget of {budget_s:.0f} s of training over {runs} run(s): {seconds_per_row:.2f} s a row "
           f"({mean_tokens:.0f} tokens on average) at micro batch 1 on {device}, measured just now")
    if train_rows == floor and rows < floor:
        why += f"; raised to {MIN_STEPS} optimizer steps a run, the fewest that measure training"
    why += why_all
    sizing = Sizing(max_samples, why)

    record.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(record) as tmp:
        tmp.write_text(json.dumps(sizing.to_dict(), indent=1))
    return sizing


def measure_row(settings: dict[str, Any], device: str) -> tuple[float, float, int]:
    """(seconds a training row takes at micro batch 1, the rows' mean tokens, the rows): forward and backward of the
    run's own model, method and data, timed as the batch probe times its steps, on a row of median
    length (a step of a few hundred tokens runs at much the same tokens/s whatever its length)."""
    import numpy as np
    import torch

    from tunebench.core import precision as precision_
    from tunebench.data import batching, mixture
    from tunebench.jobs.parts import runner
    from tunebench.jobs.parts.finetune_model import build_model
    from tunebench.model import models
    from tunebench.training.autotune.probe import probe_step

    cfg = load_config(options={**settings, "hardware.device": device})
    parts = mixture.parts(cfg.data)
    hw_plan = hardware.plan(device, cfg.hardware.precision, hardware.detect(), "off", cfg.hardware.threads)  # eager, as runs start
    runner.apply_plan(hw_plan)
    loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download)
    data, _, _ = mixture.tokenize(parts, loaded.tokenizer, models.cache_dir())
    model, _ = build_model(cfg, loaded, hw_plan.precision, torch.device(hw_plan.device))
    autocast = precision_.autocast_dtype(hw_plan.precision)
    lengths = data.lengths()
    median_row = int(np.argsort(lengths)[len(lengths) // 2])
    step = probe_step(model, lambda size: batching.collate(data, [median_row] * size, loaded.tokenizer.pad_token_id),
                      torch.device(hw_plan.device), autocast)
    tokens_per_s = max(step(1)[0] for _ in range(2))  # a fresh process's first steps run slow: 6 steps, the best 2
    mean_tokens = float(np.mean(lengths))  # a run pays for its rows' mean length
    return mean_tokens / tokens_per_s, mean_tokens, len(lengths)
