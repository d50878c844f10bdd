"""`--attention auto`: time a probe step with each kernel that can run here, keep the fastest."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.core.precision import DTYPES
from tunebench.model import kernels, methods
from tunebench.training.autotune import Shape, cached, store
from tunebench.training.autotune.budget import ATTENTION_PART, Budget
from tunebench.training.autotune.known import Known
from tunebench.training.autotune.probe import (
    enable_checkpointing,
    free_after_oom,
    is_oom,
    memory_budget_mb,
    memory_free_mb,
)

ATTENTION_KERNELS = ("sdpa", "eager", kernels.NAME)  # run on every device and precision


def candidates(device: torch.device, precision: str, model=None) -> tuple[str, ...]:
    """The kernels that can run here, for this architecture. flash-attn's joins on a CUDA GPU in 16-bit when
    installed; with packed rows, transformers hands it the restarting position_ids and it runs
    variable-length sequences without padding or a block mask."""
    names = ATTENTION_KERNELS
    if device.type == "cpu":
        # Measured first, so it is the one a short run's measuring budget keeps when it has room for one: on
        # 2 AMX cores in bf16 tunebench's kernel was fastest at every size measured (SmolLM2-135M: 890 tokens/s
        # against eager's 844 and sdpa's 656; the 0.42B and 1.07B Llamas under --measure full), sdpa slowest.
        names = (kernels.NAME, "eager", "sdpa")
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            names += ("flash_attention_2",)
    return tuple(n for n in names if model is None or not unsupported(model, n))


def unsupported(model, impl: str) -> str | None:
    """Why `model`'s architecture cannot run kernel `impl` (None if it can), from the flags transformers
    keeps on each model class. Gemma 2 has no sdpa path (its logits soft-capping is in eager and flex only);
    ours falls back to sdpa for anything but plain causal attention, so it needs sdpa too."""
    base = methods.base_of(model)
    name = type(base).__name__
    if impl in ("sdpa", kernels.NAME) and not getattr(base, "_supports_sdpa", True):
        return f"{name} has no sdpa attention in transformers"
    if impl == kernels.NAME and not getattr(base, "_supports_attention_backend", True):
        return f"{name} takes no registered attention function"
    if impl == "flash_attention_2" and not getattr(base, "_supports_flash_attn", True):
        return f"{name} has no flash-attention path in transformers"
    return None


# Kernels whose first-round speeds are this close are alike for the run: on 2 AVX2 cores, SmolLM2 at 128
# tokens measured 227/224/205 tokens/s at 4 rows and 159/161/167 at 1 row (the order is noise), and the
# second round took 25 of the measurement's 51 s on a cold cache.
ALIKE = 1.05


def pick(model, requested: str, measure, shape: Shape, too_big=lambda impl: None, is_oom=is_oom,
         candidates: tuple[str, ...] = ATTENTION_KERNELS, budget: Budget | None = None,
         known: Known | None = None, rows: int | None = None) -> Decision:
    """Set the attention kernel; `auto` times a probe step with each of `candidates` and keeps the
    fastest (cached).

    `too_big(impl)` says why a kernel would not fit in memory (None if it would): on a CPU an
    allocation past the RAM is not an exception but the kernel's OOM killer, so a kernel whose
    T x T weights would not fit is never tried, and a cached choice that no longer fits is measured again.
    With a `budget`, a kernel whose measurement would not fit in what is left of its half of it is not
    measured (the first always is), and the partial choice is not cached. With `known` (the nearest machine
    class's record), the kernels are measured fastest on record first, and one whose predicted gain over the
    fastest measured would save less training time than measuring it costs is not measured: its row gives the
    record's ratio.
    """
    kernels.register()
    if requested != "auto":
        if requested not in candidates:
            why = unsupported(model, requested) or "it needs a CUDA GPU, bf16 or fp16, and the flash-attn package"
            raise TunebenchError(f"--attention {requested} cannot run here: {why}; use --attention auto (it measures "
                                 f"{', '.join(candidates)})")
        model.set_attn_implementation(requested)
        return Decision("attention", requested, "asked for")
    key = shape.key("attention", candidates=candidates)
    if known is not None and budget is not None:
        candidates = known.kernel_order(candidates)
    hit = cached(key)
    if hit is None or too_big(hit["value"]):
        skipped = {impl: why for impl in candidates if (why := too_big(impl))}
        speeds = {impl: 0.0 for impl in candidates if impl not in skipped}
        cost, partial = 0.0, False  # the last measurement's seconds; whether the budget left a kernel out
        for round_ in range(2):  # round-robin, best of two: a shared machine's drift hits every kernel alike
            if round_ and (len(speeds) < 2 or max(speeds.values()) <= ALIKE * min(speeds.values())):
                break  # one kernel left, or within 5% after one round: a second round decides nothing this run needs
            for impl in list(speeds):
                why = _not_worth(impl, speeds, cost, budget, known) if budget is not None and cost and not speeds[impl] \
                    else None
                if not why and not speeds[impl] and any(speeds.values()):  # what the measured ones peaked at says
                    why = too_big(impl)
                if why:
                    skipped[impl], partial = why, True
                    del speeds[impl]
                    continue
                if budget is not None and cost and not budget.affords(cost, ATTENTION_PART):
                    if not speeds[impl]:  # never measured: left out, and said so
                        skipped[impl], partial = budget.why_not(cost, ATTENTION_PART), True
                        del speeds[impl]
                    continue
                model.set_attn_implementation(impl)
                try:
                    speed, cost = budget.timing(measure) if budget is not None else (measure(), 0.0)
                except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else re-raises
                    if not is_oom(e):
                        raise
                    free_after_oom(model)
                    skipped[impl] = "out of memory"
                    del speeds[impl]
                    continue
                speeds[impl] = max(speeds[impl], speed)
                if budget is not None:
                    budget.saw(speed)
        if not speeds:
            why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
            raise NoneFit(f"no attention kernel fits in memory ({why}); lower --max-length or --batch-size")
        ranked = sorted(speeds, key=speeds.get, reverse=True)
        hit = {"value": ranked[0], "reason": "measured " + ", ".join(f"{speeds[k]:,.0f} ({k})" for k in ranked)
                                            + " tokens/s" + "".join(f"; {k} skipped: {v}" for k, v in skipped.items())
               + (f"; record: {known.source}" if any("on record" in v for v in skipped.values()) else ""),
               "speeds": {k: round(v, 1) for k, v in speeds.items()}, "rows": rows}  # for `tunebench hw --record`
        if not partial:
            store(key, hit)
    model.set_attn_implementation(hit["value"])
    return Decision("attention", hit["value"], hit["reason"])


def _not_worth(impl: str, speeds: dict[str, float], cost: float, budget: Budget, known: Known | None) -> str | None:
    """Why measuring kernel `impl` would not repay its ~`cost` seconds, from the record's ratio of it to the
    fastest kernel measured so far (None: no record of it, or it might)."""
    best = max((k for k in speeds if speeds[k]), key=speeds.get, default=None)
    ratio = known.kernel_ratio(impl, best) if known is not None and best else None
    if ratio is None:
        return None
    saves = (budget.training_s() or 0.0) * max(0.0, 1 - 1 / ratio)
    if saves > cost:
        return None
    return (f"predicted {ratio:.2f}x {best} on record, not measured: ~{cost:.0f} s to measure against ~{saves:.0f} s "
            "it could save")


def fit(model, rows: int, length: int, precision: str, device: torch.device,
        peaks: Callable[[], dict[str, float]] | None = None, planned: Callable[[str], float] | None = None):
    """`too_big` for `pick`: a kernel whose kept attention weights would take over half the memory free now (the
    rest of the step needs room too) is not tried; nor one whose step would peak past the memory a step may reach
    (the budget the batch probe keeps to): once others were measured (`peaks`: {kernel: the peak MB its step reached
    at these rows}), predicted as a measured kernel's peak plus the difference of their kept weights; before any
    was, the memory plan's peak of the probe step (`planned`: kernel -> MB, the run's plan at these rows). On a
    CPU a step past the RAM is the OOM killer: a GRPO-shaped probe (4 rows x 1,024 tokens, SmolLM2-135M LoRA,
    fp32) peaked at 20.1 GB with tunebench's kernel on a 23 GB machine, and eager, which keeps as many weights,
    measured next, was killed at 24 GB (2026-12-03); on a machine with less memory the first kernel is the one
    killed, and only a prediction comes before it."""
    free = memory_free_mb(device)
    _, budget = memory_budget_mb(device)
    itemsize = DTYPES[precision].itemsize

    def weights(impl: str) -> float:
        return kernels.saved_weights_mb(model.config, rows, length, impl, itemsize)

    def too_big(impl: str) -> str | None:
        need = weights(impl)
        if need > free / 2:
            return f"its {rows} x {length} x {length} attention weights need ~{need:,.0f} MB of {free:,.0f} MB free"
        measured = {other: peak for other, peak in (peaks() if peaks is not None else {}).items() if other != impl}
        for other, peak in measured.items():
            predicted = peak + need - weights(other)
            if predicted > budget:
                return (f"predicted to peak at ~{predicted:,.0f} MB, past the {budget:,.0f} MB a step may reach: "
                        f"{other} peaked at {peak:,.0f} MB at {rows} x {length} tokens, keeping "
                        f"{weights(other):,.0f} MB of attention weights to its {need:,.0f}")
        if not measured and planned is not None and (plan := planned(impl)) > budget:
            return (f"its memory plan at {rows} x {length} tokens peaks at ~{plan:,.0f} MB, past the {budget:,.0f} MB "
                    "a step may reach")
        return None

    return too_big


class Peaks(NamedTuple):
    """What a kernel's probe step would peak at, for `fit`: `measured`, {kernel: the peak MB its step reached at the
    pick's rows}; `planned`, kernel -> the memory plan's peak MB of that step (read when called: recomputation
    turned on lowers it)."""

    measured: Callable[[], dict[str, float]] | None = None
    planned: Callable[[str], float] | None = None


class NoneFit(TunebenchError):
    """Every attention kernel ran out of memory (or would): the rows do not fit as the model stands."""


def decide(model, requested: str, measure, shape: Shape, rows: int, widest: int, precision: str,
           device: torch.device, checkpointing: str = "off", budget: Budget | None = None,
           known: Known | None = None, peaks: Peaks | None = None) -> list[Decision]:
    """The attention row for a run: what fits at `rows` x `widest` tokens, measured or as asked. With
    gradient checkpointing on auto, rows that fit no kernel are measured again with recomputation on, and a
    gradient_checkpointing row says why (on an H200 filled to 1.5 GB, one 1,024-token row of GPT-2 fit no
    kernel without it, and the run stopped before the batch probe could turn it on). `peaks`: see `Peaks`."""
    seen = peaks or Peaks()

    def one() -> Decision:
        return pick(model, requested, measure, shape, fit(model, rows, widest, precision, device, seen.measured,
                                                          seen.planned),
                    candidates=candidates(device, precision, model), budget=budget, known=known, rows=rows)

    try:
        return [one()]
    except NoneFit:
        if checkpointing != "auto":
            raise
    free_after_oom(model)
    enable_checkpointing(model)
    return [Decision("gradient_checkpointing", True, f"{rows} row(s) of {widest} tokens fit no attention kernel without it"),
            one()]



