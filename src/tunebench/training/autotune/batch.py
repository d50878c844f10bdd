"""`--batch-size auto`: measure the micro batches that divide the effective batch, keep the fastest.

`probe` takes a step function, so it is tested with fakes; `probed_micro_batch` runs it on the real
model (the longest rows, so memory is the worst case) or reuses the cached probe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tunebench.core.batch_rule import micro_candidates
from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.training.autotune import Key, Shape, cached, store
from tunebench.training.autotune.budget import Budget
from tunebench.training.autotune.known import Known, model_size
from tunebench.training.autotune.probe import (
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
    status: str  # ok | oom | over budget | skipped: predicted over budget | skipped: not measured | predicted
    note: str = ""  # why a size was not measured, and where a predicted one's figure comes from


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


# A step up that gains less than this is flat: the sweep stops climbing (SmolLM2 on 2 AVX512-BF16 cores: micro 4 -> 8
# gained 0.2% after +43% and +23%, with 1.3x the memory).
FLAT = 0.05
FASTER = 1.05  # a size on record is chosen unmeasured only when predicted at least this much faster
MEMORY_STOPS = ("over budget", "out of memory", "out of memory below it")  # a sweep past these sizes cannot fit


def probe(step: StepFn, sizes: list[int], budget_mb: float, baseline_mb: float,
          is_oom: Callable[[BaseException], bool], time_budget: Budget | None = None, known: Known | None = None,
          seen: dict[int, tuple[float, float, float]] | None = None) -> Result:
    """Measure micro batches until the evidence says the next one is not worth its measuring; keep the fastest.

    Without a `time_budget` (--measure full) every size is measured, smallest first, up to memory. With one, the
    first size is always measured: the record's fastest (`known`, the nearest machine class's outcome) when a size
    in `seen` predicts its memory, else the smallest. From there the sweep climbs while the next size could save more training time than measuring it
    costs: its gain is the record's ratio where the record measured it, else half the last measured step's gain
    (on the curves on record each step up gained 0.01-0.82x the step before's, 0.53x at the median), else unknown,
    and then the budget's clock decides. A flat step (< 5%) stops the climb. With a record, the sizes below the first are considered
    the same way. A size not measured is taken from the record's ratio when it predicts it faster (and its
    memory, predicted from the nearest measured size, fits): the row says predicted. `seen` holds sizes
    already timed on this model with the kernel kept ({size: (tokens/s, peak MB, seconds)}, the attention
    pick's), reused at no cost (one that peaked past `budget_mb` is over budget, as are the sizes above it). Memory
    above the baseline grows about linearly with the micro batch, so a size predicted past `budget_mb` is never
    tried (no swap, no OOM killer).
    """
    sizes = sorted(sizes)
    measured, rows = _already_timed(seen or {}, sizes, budget_mb)
    # The record's fastest first, when a size already timed predicts its memory; a first size measured blind is
    # the smallest (on a CPU a step past the RAM is the OOM killer, not an exception).
    start = known.best_micro(sizes) if known is not None and time_budget is not None and measured else None
    order = [start, *[s for s in sizes if s > start], *[s for s in reversed(sizes) if s < start]] \
        if start is not None else sizes
    stopped = {"up": "", "down": ""}
    for size in order:
        direction = "down" if start is not None and size < start else "up"
        if size in rows:  # timed already, or above a size over budget
            continue
        near = min(measured, key=lambda s: abs(s - size)) if measured else None
        predicted_mb = None
        if near is not None:
            tps_near, peak_near, sec_near = measured[near]
            predicted_mb = baseline_mb + max(peak_near - baseline_mb, 0.0) * size / near
            if predicted_mb > budget_mb:
                rows[size] = Probe(size, None, round(predicted_mb, 1), "skipped: predicted over budget")
                stopped[direction] = stopped[direction] or "over budget"
                continue
        if stopped[direction] in MEMORY_STOPS:
            rows[size] = Probe(size, None, None, "skipped: " + stopped[direction])
            continue
        if stopped[direction]:  # after a measured flat step no record overrules it: nothing larger is predicted
            rows[size] = _unmeasured(size, known, _best(measured), stopped[direction], predicted_mb,
                                     predict="flat" not in stopped[direction])
            continue
        if near is not None and time_budget is not None:
            cost = sec_near * size / near
            gain, why = _gain(size, measured, known)
            b = _best(measured)
            saves = time_budget.run_tokens / b[1] * (1 - 1 / (1 + gain)) if gain is not None and gain > 0 else 0.0
            worth = time_budget.affords(cost) if gain is None else saves > cost
            if not worth:
                reason = (time_budget.why_not(cost) if gain is None else
                          f"not measured: ~{cost:.0f} s to measure against ~{saves:.0f} s it could save"
                          + (f" ({why})" if why != "on record" else ""))
                rows[size] = _unmeasured(size, known, b, reason, predicted_mb)
                stopped[direction] = reason
                continue
        try:
            (tps, peak), seconds = time_budget.timing(functools.partial(step, size)) \
                if time_budget is not None else (step(size), 0.0)
        except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else re-raises
            if not is_oom(e):
                raise
            rows[size] = Probe(size, None, None, "oom")
            stopped[direction] = "out of memory below it" if direction == "down" else "out of memory"
            continue
        if peak > budget_mb:
            rows[size] = Probe(size, round(tps, 1), round(peak, 1), "over budget")
            stopped[direction] = "over budget"
            continue
        rows[size] = Probe(size, round(tps, 1), round(peak, 1), "ok")
        measured[size] = (tps, peak, seconds)
        if time_budget is not None:
            time_budget.saw(tps)
            stopped[direction] = _step_stop(measured, size, direction) or stopped[direction]
    probes = _charge_first_steps(tuple(rows[s] for s in sizes if s in rows), measured, known, time_budget)
    return _choose(probes, known)


def _already_timed(seen: dict[int, tuple[float, float, float]], sizes: list[int], budget_mb: float):
    """(measured, rows) of the sizes timed already ({size: (tokens/s, peak MB, seconds)}, the kernel kept):
    those within `budget_mb` are measured, rows as they are; one that peaked past it is over budget, as are the
    sizes above it, never timed: the towns benchmark's RFT probe (4 rows x 1,024 tokens) peaked at 20.1 GB in the
    attention pick on a 23 GB machine, and timing it again in the sweep held 24.3 GB for minutes with nothing left
    for the page cache (2026-12-03)."""
    measured = {size: m for size, m in seen.items() if size in sizes and m[1] <= budget_mb}
    over = {size: m for size, m in seen.items() if size in sizes and m[1] > budget_mb}
    rows = {size: Probe(size, round(tps, 1), round(peak, 1), "ok" if size in measured else "over budget")
            for size, (tps, peak, _) in {**measured, **over}.items()}
    rows.update({size: Probe(size, None, None, "skipped: over budget") for size in sizes
                 if over and size > min(over) and size not in rows})
    return measured, rows


def _charge_first_steps(probes: tuple[Probe, ...], measured: dict[int, tuple[float, float, float]],
                        known: Known | None, time_budget: Budget | None) -> tuple[Probe, ...]:
    """A predicted size is one no probe ran: on a class whose record says its first steps cost extra (AMX bf16:
    ~4.6 micro batches of it, new shapes' kernels and first-touched memory), it is kept only when what it saves
    over the run repays them; else its row says so and it is left out of the choice."""
    k = known.first_steps if known is not None else None
    best = _best(measured)
    if not k or time_budget is None or best is None:
        return probes
    out = []
    for p in probes:
        if p.status != "predicted" or not p.tokens_per_s:
            out.append(p)
            continue
        near = min(measured, key=lambda s: abs(s - p.micro_batch_size))
        tps, _, seconds = measured[near]
        one = seconds / 3 * p.micro_batch_size / near * tps / p.tokens_per_s  # a probe step is 3 micro batches
        cost = k * one
        saves = time_budget.run_tokens / best[1] * (1 - best[1] / p.tokens_per_s)
        if saves > cost:
            out.append(p)
            continue
        out.append(Probe(p.micro_batch_size, None, p.peak_memory_mb, "skipped: not measured",
                         f"{p.note}; its first steps would cost ~{cost:.1f} s ({k:g} micro batches of it on record for "
                         f"a size no probe ran) against ~{saves:.1f} s it could save"))
    return tuple(out)


def _best(measured: dict[int, tuple[float, float, float]]) -> tuple[int, float] | None:
    """The fastest size measured so far and its tokens/s."""
    ok = [(s, m[0]) for s, m in measured.items()]
    return max(ok, key=lambda x: x[1]) if ok else None


def _gain(size: int, measured: dict[int, tuple[float, float, float]], known: Known | None
          ) -> tuple[float | None, str]:
    """The gain expected of `size` over the best so far, and what says so."""
    b = _best(measured)
    if b is None:
        return None, ""
    ratio = known.micro_ratio(size, b[0]) if known is not None else None
    if ratio is not None:
        return ratio - 1, "on record"
    below = sorted(s for s in measured if s < size)
    if size > b[0] and len(below) >= 2:  # the run's own trend, halved
        g = measured[below[-1]][0] / measured[below[-2]][0] - 1
        return g / 2, f"half the {g:+.0%} of micro {below[-2]} -> {below[-1]}"
    curve = sorted(s for s in (known.outcome.micro_batch if known is not None else {}) if s <= b[0])
    if size > b[0] and len(curve) >= 2:  # the record's trend up to the best measured size, halved
        g = known.micro_ratio(curve[-1], curve[-2]) - 1
        return g / 2, f"half the {g:+.0%} of micro {curve[-2]} -> {curve[-1]} on record"
    return None, ""


def _step_stop(measured: dict[int, tuple[float, float, float]], size: int, direction: str) -> str | None:
    """Why the sweep stops going `direction` after measuring `size`: a flat step up, or a step down that gained
    (the size above it was faster); None to go on."""
    step_from = max((s for s in measured if s < size), default=None) if direction == "up" else \
        min((s for s in measured if s > size), default=None)
    if step_from is None:
        return None
    g = measured[size][0] / measured[step_from][0] - 1 if direction == "up" else \
        measured[step_from][0] / measured[size][0] - 1
    if direction == "up" and g < FLAT:
        return f"not measured: micro {step_from} -> {size} gained {g:+.0%}, flat"
    if direction == "down" and g >= FLAT:
        return f"not measured: micro {size} -> {step_from} gained {g:+.0%}"
    return None


def _choose(probes: tuple[Probe, ...], known: Known | None) -> Result:
    """The fastest size measured, or one predicted at least FASTER than it, with the reason and the sizes left."""
    ok = [p for p in probes if p.status == "ok"]
    if not ok:
        return Result(0, probes, "no micro batch fits")
    fastest = max(ok, key=lambda p: p.tokens_per_s or 0)
    predicted = [p for p in probes if p.status == "predicted" and (p.tokens_per_s or 0) > FASTER * fastest.tokens_per_s]
    if predicted:
        chosen = max(predicted, key=lambda p: p.tokens_per_s or 0)
        reason = (f"predicted fastest: {chosen.tokens_per_s:,.0f} tokens/s, "
                  f"{chosen.tokens_per_s / fastest.tokens_per_s:.2f}x the {fastest.tokens_per_s:,.0f} measured at "
                  f"micro {fastest.micro_batch_size} ({chosen.note})")
    else:
        chosen = fastest
        reason = f"fastest measured: {fastest.tokens_per_s:,.0f} tokens/s of {len(ok)} that fit"
    left = [p for p in probes if p.status in ("predicted", "skipped: not measured") and p is not chosen]
    reason += "".join(f"; {p.micro_batch_size}: {p.note}" for p in left)
    if known is not None and any("on record" in p.note for p in (*left, chosen)):
        reason += f"; record: {known.source}"
    return Result(chosen.micro_batch_size, probes, reason, partial=bool(predicted or left))


def _unmeasured(size: int, known: Known | None, best: tuple[int, float] | None, reason: str,
                predicted_mb: float | None = None, predict: bool = True) -> Probe:
    """The row of a size the sweep did not measure: predicted from the record where it measured this size."""
    ratio = known.micro_ratio(size, best[0]) if predict and known is not None and best is not None else None
    if ratio is None:
        return Probe(size, None, None, "skipped: not measured", reason)
    return Probe(size, round(best[1] * ratio, 1), round(predicted_mb, 1) if predicted_mb else None, "predicted",
                 f"{ratio:.2f}x micro {best[0]} on record; {reason}")


def format_table(result: Result) -> str:
    lines = ["  micro_batch  tokens/s   peak MB  status"]
    for p in result.probes:
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        mem = f"{p.peak_memory_mb:,.0f}" if p.peak_memory_mb else "-"
        mark = " <- chosen" if p.micro_batch_size == result.micro_batch_size else ""
        lines.append(f"  {p.micro_batch_size:>11}  {tps:>8}  {mem:>8}  {p.status}{mark}")
    return "\n".join(lines)


def measurement_key(shape: Shape, effective_batch_size: int, n_train: int, ranks_sharing: int = 1) -> Key:
    return shape.key("batch", effective_batch_size=effective_batch_size, rows=min(n_train, effective_batch_size),
                     **({"ranks_sharing": ranks_sharing} if ranks_sharing > 1 else {}))


def cached_speed(shape: Shape, effective_batch_size: int, n_train: int, micro: int, ranks_sharing: int = 1) \
        -> float | None:
    """Tokens/s an earlier probe of this shape measured for `micro`, if it measured that size (no cost)."""
    return cached_speeds(measurement_key(shape, effective_batch_size, n_train, ranks_sharing)).get(micro)


def cached_speeds(key: Key) -> dict[int, float]:
    """{micro batch: tokens/s} of every size the cached probe under `key` measured (none predicted), one process's."""
    hit = cached(key)
    if not hit or "result" not in hit:
        return {}
    return {p.micro_batch_size: p.tokens_per_s for p in Result.from_dict(hit["result"]).probes
            if p.status == "ok" and p.tokens_per_s}


def probed_micro_batch(step: StepFn, shape: Shape, effective_batch_size: int, n_train: int, max_length: int,
                device: torch.device, ranks_sharing: int = 1, time_budget: Budget | None = None,
                known: Known | None = None, seen: dict[int, tuple[float, float, float]] | None = None) \
        -> tuple[int, list[Decision], float]:
    """Probe micro batches (or reuse the cached probe); return the winner, its rows and its tokens/s: the probe's
    part of the micro batch's decision, which runplan.micro_batch makes whole.
    `effective_batch_size` is one rank's share; `ranks_sharing` ranks split this machine's RAM; `known` the
    nearest machine class's record and `seen` the sizes the attention pick timed (see `probe`)."""

    key = measurement_key(shape, effective_batch_size, n_train, ranks_sharing)
    hit = cached(key)
    result = Result.from_dict(hit["result"]) if hit and "result" in hit else None
    source = "cached probe"
    rows: list[Decision] = []
    if result is not None and hit.get("gradient_checkpointing"):
        enable_checkpointing(step.model)  # the probe that chose this size needed it
        rows.append(("gradient_checkpointing", True, "micro batch 1 did not fit without it (cached probe)"))
    if result is None:
        source = "probed now"
        sizes = micro_candidates(effective_batch_size, 1, n_train)
        baseline, budget = memory_budget_mb(device, ranks_sharing)
        result = probe(step, sizes, budget, baseline, is_oom, time_budget, known, seen)
        if result.micro_batch_size == 0 and shape.gradient_checkpointing == "auto":
            free_after_oom(step.model)
            enable_checkpointing(step.model)
            result = probe(step, sizes, budget, baseline, is_oom, time_budget, known)
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
                        "gradient_checkpointing": shape.gradient_checkpointing == "auto" and checkpointing_on(step.model),
                        **model_size(step.model)})  # the model's size and depth, for `tunebench hw --record`
    print(f"batch-size probe ({source}):\n{format_table(result)}")
    rows.insert(0, Decision("micro_batch_size", result.micro_batch_size, f"{result.reason} ({source})"))
    speed = next(p.tokens_per_s for p in result.probes if p.micro_batch_size == result.micro_batch_size)
    return result.micro_batch_size, rows, speed
