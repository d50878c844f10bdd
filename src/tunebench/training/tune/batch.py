"""`--batch-size auto`: measure the micro batches that divide the effective batch, keep the fastest.

`probe` takes a step function, so it is tested with fakes; `micro_batch` runs it on the real
model (the longest rows, so memory is the worst case) or reuses the cached probe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tunebench.core.batch_rule import micro_candidates
from tunebench.core.decision import Decision as Row
from tunebench.core.errors import TunebenchError
from tunebench.training.tune import Shape, cached, store
from tunebench.training.tune.budget import Budget
from tunebench.training.tune.probe import (
    StepFn,
    checkpointing_on,
    enable_checkpointing,
    free_after_oom,
    is_oom,
    memory_budget_mb,
)


@dataclass(frozen=True)
class Probe:
    micro_batch_size: int
    tokens_per_s: float | None
    peak_memory_mb: float | None
    status: str  # ok | oom | over budget | skipped: predicted over budget


@dataclass(frozen=True)
class Result:
    micro_batch_size: int
    probes: tuple[Probe, ...]
    reason: str
    partial: bool = False  # the measuring budget left larger sizes unmeasured: not cached

    def to_dict(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "probes": [asdict(p) for p in self.probes],
                "reason": self.reason, "partial": self.partial}

    @staticmethod
    def from_dict(d: dict) -> Result:
        return Result(d["micro_batch_size"], tuple(Probe(**p) for p in d["probes"]), d["reason"],
                      d.get("partial", False))


def probe(step: StepFn, sizes: list[int], budget_mb: float, baseline_mb: float,
          is_oom: Callable[[BaseException], bool], time_budget: Budget | None = None) -> Result:
    """Try sizes in increasing order; stop at the first OOM, or before one predicted to exceed the budget.

    Memory above the baseline grows about linearly with the micro batch, so the next size's peak is
    predicted from the last one's and never tried when it would not fit (no swap, no OOM killer). A probe
    step's time grows about linearly too, so with a `time_budget` the next size is not tried when its
    predicted time would take measuring past the budget (the result's `partial` is then True).
    """
    probes: list[Probe] = []
    last: tuple[int, float, float] | None = None  # size, peak MB, seconds
    partial = ""
    for size in sorted(sizes):
        if last is not None:
            predicted = baseline_mb + (last[1] - baseline_mb) * size / last[0]
            if predicted > budget_mb:
                probes.append(Probe(size, None, round(predicted, 1), "skipped: predicted over budget"))
                break
            cost = last[2] * size / last[0]
            if time_budget is not None and not time_budget.affords(cost):
                partial = time_budget.why_not(cost)
                probes.append(Probe(size, None, None, "skipped: measuring budget"))
                break
        try:
            (tokens_per_s, peak), seconds = time_budget.timing(functools.partial(step, size)) \
                if time_budget is not None else (step(size), 0.0)
        except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else re-raises
            if not is_oom(e):
                raise
            probes.append(Probe(size, None, None, "oom"))
            break
        if peak > budget_mb:
            probes.append(Probe(size, round(tokens_per_s, 1), round(peak, 1), "over budget"))
            break
        probes.append(Probe(size, round(tokens_per_s, 1), round(peak, 1), "ok"))
        if time_budget is not None:
            time_budget.saw(tokens_per_s)
        last = (size, peak, seconds)
    ok = [p for p in probes if p.status == "ok"]
    if not ok:
        return Result(0, tuple(probes), "no micro batch fits")
    best = max(ok, key=lambda p: p.tokens_per_s or 0)
    larger = [s for s in sorted(sizes) if s > ok[-1].micro_batch_size]
    return Result(best.micro_batch_size, tuple(probes),
                  f"fastest measured: {best.tokens_per_s:,.0f} tokens/s of {len(ok)} that fit"
                  + (f"; {', '.join(map(str, larger))} {partial}" if partial else ""), partial=bool(partial))


def format_table(result: Result) -> str:
    lines = ["  micro_batch  tokens/s   peak MB  status"]
    for p in result.probes:
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        mem = f"{p.peak_memory_mb:,.0f}" if p.peak_memory_mb else "-"
        mark = " <- chosen" if p.micro_batch_size == result.micro_batch_size else ""
        lines.append(f"  {p.micro_batch_size:>11}  {tps:>8}  {mem:>8}  {p.status}{mark}")
    return "\n".join(lines)


def _key(shape: Shape, effective_batch_size: int, n_train: int, ranks_sharing: int) -> str:
    return shape.key("batch", effective_batch_size=effective_batch_size, rows=min(n_train, effective_batch_size),
                     **({"ranks_sharing": ranks_sharing} if ranks_sharing > 1 else {}))


def cached_speed(shape: Shape, effective_batch_size: int, n_train: int, micro: int, ranks_sharing: int = 1) \
        -> float | None:
    """Tokens/s an earlier probe of this shape measured for `micro`, if it measured that size (no cost)."""
    hit = cached(_key(shape, effective_batch_size, n_train, ranks_sharing))
    if not hit or "result" not in hit:
        return None
    return next((p.tokens_per_s for p in Result.from_dict(hit["result"]).probes
                 if p.micro_batch_size == micro and p.status == "ok" and p.tokens_per_s), None)


def micro_batch(step: StepFn, shape: Shape, effective_batch_size: int, n_train: int, max_length: int,
                device: torch.device, ranks_sharing: int = 1, time_budget: Budget | None = None) \
        -> tuple[int, list[Row], float]:
    """Probe micro batches (or reuse the cached probe); return the winner, its rows and its tokens/s.
    `effective_batch_size` is one rank's share; `ranks_sharing` ranks split this machine's RAM."""

    key = _key(shape, effective_batch_size, n_train, ranks_sharing)
    hit = cached(key)
    result = Result.from_dict(hit["result"]) if hit and "result" in hit else None
    source = "cached probe"
    rows: list[Row] = []
    if result is not None and hit.get("gradient_checkpointing"):
        enable_checkpointing(step.model)  # the probe that chose this size needed it
        rows.append(("gradient_checkpointing", True, "micro batch 1 did not fit without it (cached probe)"))
    if result is None:
        source = "probed now"
        sizes = micro_candidates(effective_batch_size, 1, n_train)
        baseline, budget = memory_budget_mb(device, ranks_sharing)
        result = probe(step, sizes, budget, baseline, is_oom, time_budget)
        if result.micro_batch_size == 0 and shape.gradient_checkpointing == "auto":
            free_after_oom(step.model)
            enable_checkpointing(step.model)
            result = probe(step, sizes, budget, baseline, is_oom, time_budget)
            rows.append(("gradient_checkpointing", True, "micro batch 1 did not fit without it"))
        if result.micro_batch_size == 0:
            raise TunebenchError(
                f"no micro batch fits in memory at --max-length {max_length}; lower --max-length, "
                "use --quantization 4bit, or --gradient-checkpointing on"
            )
        # Whether the measurements needed recomputation, this probe's finding or the attention pick's (which turns
        # it on before this probe when one row fits no kernel), so that a cached run turns it on again; never
        # checkpointing the user asked for, which is the run's own "asked for" row.
        if not result.partial:  # a longer run of this shape measures the sizes the budget left out
            store(key, {"result": result.to_dict(),
                        "gradient_checkpointing": shape.gradient_checkpointing == "auto" and checkpointing_on(step.model)})
    print(f"batch-size probe ({source}):\n{format_table(result)}")
    rows.insert(0, Row("micro_batch_size", result.micro_batch_size, f"{result.reason} ({source})"))
    speed = next(p.tokens_per_s for p in result.probes if p.micro_batch_size == result.micro_batch_size)
    return result.micro_batch_size, rows, speed
