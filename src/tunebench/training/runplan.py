"""The run's plan: every decision, made once and frozen.

Both training jobs and resume apply the batch rule (batch_rule.py: effective batch = micro batch x
accumulation x world size) here: the effective batch is what the user asks (or the product they asked);
the micro batch is a speed decision (measured with `auto`) that only splits each step's rows, never
changes them (see data.batching.epoch_steps).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core.batch_rule import BatchAsk, accumulation, micro_candidates
from tunebench.core.decision import Decision, value_of
from tunebench.core.errors import TunebenchError
from tunebench.settings.schema import budget_seconds
from tunebench.training.autotune import Key
from tunebench.training.autotune.budget import Budget


def total_steps(rows: int, effective: int, epochs: float, max_steps: int | None, max_tokens: int | None = None,
                tokens_per_row: float = 1.0) -> int:
    """Optimizer steps of a run: `max_steps`; else the steps whose rows hold about `max_tokens` real tokens
    (`tokens_per_row` on average), so runs with different batch sizes see the same data; else `epochs`
    of ceil(rows / effective batch) steps each (the last step of an epoch may be short)."""
    if max_steps:
        return max_steps
    if max_tokens:
        return max(1, round(max_tokens / (effective * tokens_per_row)))
    return max(1, math.ceil(epochs * math.ceil(rows / effective)))


def fit_time(budget: str | None, steps: int, tokens_per_step: float, tokens_per_s: float | None,
             measure_s: float, resumed_steps: int | None = None) -> tuple[int, Decision | None]:
    """(steps, their row) under --time-budget: as many steps as the budget left after measuring trains at the
    measured speed, never more than `steps`; an interrupted run resumes with the steps it was given."""
    if budget is None:
        return steps, None
    if resumed_steps is not None:
        return resumed_steps, Decision("total_steps", resumed_steps, f"the interrupted run's (--time-budget {budget})")
    if not tokens_per_s:
        raise TunebenchError(f"--time-budget {budget} needs the measured speed of this run's steps, which it has not "
                             "(a micro batch asked for and never measured, or GRPO's steps, which also sample); leave "
                             "--batch-size on auto, or set --max-steps instead")
    left = budget_seconds(budget) - measure_s
    fit = int(left * tokens_per_s / tokens_per_step) if left > 0 else 0
    if fit < 1:
        raise TunebenchError(f"--time-budget {budget} leaves no time to train: measuring took {measure_s:.0f} s and "
                             f"one step takes about {tokens_per_step / tokens_per_s:.1f} s; raise it")
    took = min(fit, steps)
    # two decimals under 10 s, so the row's own figures give back its step count (a tenth of a second is 5% of 2 s)
    why = (f"--time-budget {budget}: {left:.{2 if left < 10 else 1}f} s left after {measure_s:.1f} s of measuring, at the measured "
           f"{tokens_per_s:,.0f} tokens/s a step of {tokens_per_step:,.0f} tokens")
    return took, Decision("total_steps", took, why + (f"; capped at the {steps} the epochs or max steps give"
                                                       if fit > steps else ""))


def sampling_budget(budget: str | None, steps: int, measure_s: float) -> tuple[float | None, Decision | None]:
    """(the seconds of training the loop may take, the steps' row) under --time-budget for a run whose steps sample
    (GRPO, RFT): their time follows what they draw, which no probe measures, so the budget is a deadline the loop
    keeps (loop.LoopSettings.time_limit_s), not a step count worked out ahead; `steps` stays the most it runs."""
    if budget is None:
        return None, None
    left = budget_seconds(budget) - measure_s
    if left <= 0:
        raise TunebenchError(f"--time-budget {budget} leaves no time to train: measuring took {measure_s:.0f} s; "
                             "raise it")
    return left, Decision("total_steps", steps, f"at most {steps}: --time-budget {budget} ends the run after the "
                          f"step that finishes past {left:.0f} s of training ({measure_s:.1f} s went to measuring); its "
                          "steps sample, which no probe times, so their number is not known ahead; the learning-rate "
                          f"schedule spans the {steps}")


def estimate_row(forecast, measure_s: float) -> Decision | None:
    """How long the training will take (plancheck.Forecast: the run's own batches' positions, padding included, at
    the steady speed it predicts, plus the first steps' extra), and measuring's share of the whole."""
    train_s = forecast.train_s
    if train_s is None:
        return None
    share = 100 * measure_s / (measure_s + train_s) if measure_s + train_s > 0 else 0.0
    clock = f"{train_s / 60:.0f} min" if train_s >= 90 else f"{train_s:.0f} s"
    if not forecast.positions_per_s:  # steps that sample (GRPO): counted in steps
        return Decision("time_estimate", f"about {clock}", f"{forecast.steps:,} steps at {forecast.step_s:.1f} s a "
                        f"step, {forecast.speed_from} (evaluations and checkpoints not included); measuring took "
                        f"{measure_s:.0f} s, {share:.0f}% of measuring and training together")
    w = forecast.work
    first = f" + {forecast.first_steps_s:.1f} s for the first steps" if forecast.first_steps_s >= 0.05 else ""
    return Decision("time_estimate", f"about {clock}", f"{w.positions:,.0f} positions ({w.tokens:,.0f} real tokens, "
                    f"{100 * (1 - w.tokens / w.positions) if w.positions else 0:.0f}% padding) at "
                    f"{forecast.positions_per_s:,.0f} a second, {forecast.speed_from}{first} (uncompiled; "
                    f"evaluations and checkpoints not included); measuring took {measure_s:.0f} s, {share:.0f}% of "
                    "measuring and training together")


def resumed_batch(resume: Path | None, world_size: int, micro_asked: int | None,
                  accum_asked: int | None) -> tuple[int, int] | None:
    """(micro batch per rank, accumulation) that continue checkpoint `resume` under this world size: its
    rows per micro-step shared out over the ranks, so every optimizer step sees the same rows it would
    have. None when not resuming. A micro batch or accumulation asked for (None: auto) that differs
    is refused, not replaced."""
    if resume is None:
        return None
    from tunebench.training import checkpoint
    made = checkpoint.check_identity(resume, {})["identity"]
    rows = made.get("rows_per_micro_step", made.get("micro_batch_size"))  # the latter: a single-process run's
    accum = made.get("grad_accum_steps")
    if not isinstance(rows, int) or not isinstance(accum, int):
        raise TunebenchError(f"checkpoint {resume} does not record its batch layout; resume from another "
                             "checkpoint or start a new --output-dir")
    if rows % world_size:
        raise TunebenchError(f"checkpoint {resume} took {rows} rows per micro-step, which {world_size} ranks cannot "
                             f"share evenly; resume with a number of processes that divides {rows}")
    micro = rows // world_size
    if (micro_asked not in (None, micro)) or (accum_asked not in (None, accum)):
        raise TunebenchError(f"checkpoint {resume} continues at micro batch {micro} x accumulation {accum} on "
                             f"{world_size} rank(s) ({rows} rows per micro-step); pass --batch-size {micro} (or "
                             "auto) and drop --grad-accum, or start a new --output-dir")
    return micro, accum


def effective_to_run(ask: BatchAsk, resume: Path | None, world_size: int) -> tuple[int, tuple[int, int] | None]:
    """(effective batch, the checkpoint's (micro, accumulation) or None): what was asked, unless a checkpoint
    being resumed fixes the batch it continues with (see resumed_batch)."""
    effective = ask.check(world_size)
    resumed = resumed_batch(resume, world_size, ask.micro, ask.accum)
    return (resumed[0] * resumed[1] * world_size if resumed else effective), resumed


@dataclass(frozen=True)
class RunPlan:
    """Every decision of a run, frozen: what the settings table prints, plan.json records and the
    loop runs with. `decisions` is the table itself, in print order, one type of row."""

    device: str
    precision: str
    threads: int
    world_size: int
    parallel: str
    attention: str
    micro_batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    total_steps: int
    compile: bool
    probed_tokens_per_s: float | None
    decisions: tuple[Decision, ...]

    def value(self, setting: str) -> Any:
        return value_of(self.decisions, setting)

    def to_json(self) -> list[dict[str, Any]]:
        return [d._asdict() for d in self.decisions]


@dataclass(frozen=True)
class Measured:
    """What the measurements decided (rank 0 measures; the other ranks receive this)."""

    decisions: tuple[Decision, ...]  # attention, gradient checkpointing, micro batch, compile
    micro_batch_size: int
    grad_accum_steps: int
    tokens_per_s: float | None
    key: Key | None = None  # the batch measurement's cache key: what a run trained is kept beside it (plancheck)
    timed: tuple[int, ...] = ()  # the micro batches a probe ran in this process: their first steps are behind them
    first_steps: float | None = None  # a cold micro batch's first steps' extra, in micro batches (class record)
    speeds: tuple[tuple[int, float], ...] = ()  # (micro batch, tokens/s) at the widest rows, all from one process
    record_ratios: tuple[tuple[int, float], ...] = ()  # (micro batch, its speed / the run's) on the class record
    record_source: str = ""  # that record: its machines and shape
    record_same_shape: bool = False  # that record measured the run's shape (size, length, method), on its machines

    @property
    def compiled(self) -> bool:
        return any(d.setting == "compile" and d.value is True for d in self.decisions)

    @property
    def attention(self) -> str:
        return str(next((d.value for d in self.decisions if d.setting == "attention"), "sdpa"))


ATTENTION_ROWS = 4  # rows the attention kernels are timed at when the micro batch is itself measured (not asked)


def batch_row(effective: int, micro: int, accum: int, world_size: int, unit: str = "") -> Decision:
    return Decision("grad_accum_steps", accum, f"effective batch {effective} = {micro} x {accum}"
                    + (f" x {world_size} ranks" if world_size > 1 else "") + unit)


@dataclass(frozen=True)
class Units:
    """What one objective trains, as the measurement and the plan count it, built by the job and passed whole (to
    measuring.decide, which adds the machine to make a Workload). A unit is one row of the effective batch: a row, a
    preference pair, a judged completion, a GRPO prompt and its group, a block of tokens."""

    n: int  # training units
    name: str  # in the steps row: "rows", "pairs", "prompts", "blocks of 256"
    tokens_each: float  # for the total steps under --max-tokens and compile's pay-off
    what: Any  # autotune.Trained: what is trained, as the measurement cache keys it
    probe_rows: Callable[[int], Any]  # size -> the widest units collated, for the probe's steps
    widest: int  # tokens an attention kernel must fit per row
    max_length: int
    quantized: bool = False
    longest: int | None = None  # the longest unit's tokens, where rows are not packed to `widest`
    micro: int | None = None  # a micro batch the objective's math fixes, taken as one asked for
    asked_reason: str = "asked for"
    batch_unit: str = ""  # after the effective batch's product in its row: " blocks of 256"
    rows_each: int = 1  # the training rows a unit is (GRPO's group): the attention kernels are timed at rows
    # (size, width) -> `size` units about `width` tokens wide, collated as probe_rows: where the run's micro batches
    # are narrower than the probe's, the plan times them too (recipe.narrow_cost); None where every one is as wide
    rows_near: Callable[[int, int], Any] | None = None


@dataclass(frozen=True)
class Workload:
    """What the measured decisions are made for, built once by measuring.decide and handed whole to `measure`: what is
    trained and where (`shape`, the measurement cache's key), its ranks, device and precision, the kernels and
    batch asked for, its lengths and rows, what the whole run will compute, how much measuring may take, and the
    nearest machine class's record (autotune.known) to start from."""

    shape: Any  # autotune.Shape
    world_size: int
    local_ranks: int  # ranks sharing this machine
    device: Any  # torch.device
    precision: str
    attention_asked: str
    attention_rows: int  # the micro batch (units) the attention kernels are timed at
    widest: int  # tokens an attention kernel must fit per row
    max_length: int
    n_train: int
    effective: int  # rows per optimizer step over all ranks
    resumed: tuple[int, int] | None  # a checkpoint's (micro batch, accumulation)
    micro_asked: int | None
    asked_reason: str
    checkpointing: str  # auto | on | off
    compile_asked: Decision
    compile_mode: str
    quantized: bool
    run_tokens: float  # the tokens the whole run will compute: compile pays off over those
    time_cap_s: float | None = None  # --time-budget: the run trains no longer, whatever its tokens
    measure_mode: str = "bounded"  # bounded: a tenth of the training time (autotune.budget); full: everything
    known: Any = None
    # (kernel, units) -> the memory plan's peak MB of a probe step of that many widest units: the attention pick
    # checks the first kernel it would time against it (attention.fit)
    planned_peak: Callable[[str, int], float] | None = None


def measure(model, step, w: Workload) -> Measured:
    """The measured decisions both jobs share, in order: attention kernel, micro batch (the effective batch stays
    fixed), gradient checkpointing, compile, for workload `w`. `step` is an autotune.probe step function. The
    attention kernel, the micro batch and compile share a measuring budget of a tenth of their training time,
    unless `w.measure_mode` is full; `w.known` orders the candidates and predicts those left unmeasured."""
    from tunebench.training.autotune import attention, compiler

    budget = Budget(w.run_tokens, cap_s=w.time_cap_s) if w.measure_mode == "bounded" else None
    rows: list[Decision] = []
    if w.checkpointing == "on":
        rows.append(Decision("gradient_checkpointing", True, "asked for"))
    timed = Timed(model, step)
    step = timed  # every probe step is remembered, the batch sweep's too: the sizes run here are warm (plancheck)
    rows += attention.decide(model, w.attention_asked, lambda: timed(w.attention_rows)[0], w.shape, w.attention_rows,
                             w.widest, w.precision, w.device, w.checkpointing, budget, w.known,
                             attention.Peaks(lambda: {k: v[1] for (k, size), v in timed.seen.items()
                                                      if size == w.attention_rows},
                                             (lambda impl: w.planned_peak(impl, w.attention_rows)) if w.planned_peak
                                             else None))
    chosen = micro_batch(w, timed, budget)
    micro, speed = chosen.size, chosen.speed
    rows += chosen.rows
    if w.checkpointing == "auto" and not any(r.setting == "gradient_checkpointing" for r in rows):
        rows.append(Decision("gradient_checkpointing", False, "the batch fits without recomputation"))
    accum = w.resumed[1] if w.resumed else accumulation(w.effective, micro, w.world_size)
    probe_s = timed.of_kernel(model).get(micro, (None, None, None))[2]  # one probe call at micro: compile makes 8
    rows.append(compiler.pick(model, w.compile_asked, w.quantized, lambda: step(micro)[0], w.run_tokens, w.shape,
                              micro, speed, w.compile_mode, budget, w.time_cap_s, probe_s))
    known = w.known
    ratios = {size: known.micro_ratio(size, micro) for size in known.outcome.micro_batch} if known is not None else {}
    return Measured(tuple(rows), micro, accum, speed, chosen.key, tuple(sorted({size for _, size in timed.seen})),
                    known.first_steps if known is not None else None, probed_speeds(timed, micro, chosen.key),
                    tuple(sorted((s, r) for s, r in ratios.items() if r and s != micro)),
                    known.source if known is not None else "", known is not None and known.same_shape)


def probed_speeds(timed: Timed, micro: int, key: Key) -> tuple[tuple[int, float], ...]:
    """The speeds probes measured at the widest rows, by micro batch, for the plan's cost of a micro batch
    (plancheck.call_cost, recipe.narrow_cost): this process's where it timed the run's micro batch, else the cached
    probe's of the shape (one earlier process's: a hand-picked row of a compare reads the auto row's sweep). Never
    the two mixed: two processes' probes of one shape differed by up to 1.9x on a 2-core Xeon (2026-12-03)."""
    from tunebench.training.autotune import batch

    here = {size: v[0] for size, v in timed.of_kernel(timed.model).items()}
    speeds = here if micro in here else batch.cached_speeds(key)
    return tuple(sorted(speeds.items()))


@dataclass(frozen=True)
class MicroBatch:
    """The micro batch decided for a workload: its size, the rows that say why (and gradient checkpointing's, where
    the probe needed it), the tokens/s a probe measured at it (None where none did), and the key its measurements
    and what runs of the shape trained are kept under."""

    size: int
    rows: tuple[Decision, ...]
    speed: float | None
    key: Key


def micro_batch(w: Workload, timed: Timed, budget: Budget | None) -> MicroBatch:
    """The one place the micro batch is decided, for workload `w` (the effective batch stays fixed): a checkpoint's
    own; else the one asked for, at the speed a probe measured it (this process's, else an earlier one's cached);
    else the probe's pick (autotune/batch.py's probed_micro_batch: the cached sweep or a new one over the sizes
    that divide the effective batch, within `budget`), replaced by a size that earlier runs of this shape on this
    machine trained faster at beyond their noise (trained_faster). `timed` is the probe step, which remembers
    every size it ran."""
    from tunebench.training.autotune import batch

    per_rank = w.effective // w.world_size
    key = batch.measurement_key(w.shape, per_rank, w.n_train, w.local_ranks)
    if w.resumed:
        why = f"the checkpoint's rows per micro-step over {w.world_size} rank(s)"
        return MicroBatch(w.resumed[0], (Decision("micro_batch_size", w.resumed[0], why),), None, key)
    if w.micro_asked is not None:
        micro, rows = w.micro_asked, [Decision("micro_batch_size", w.micro_asked, w.asked_reason)]
        speed = batch.cached_speed(w.shape, per_rank, w.n_train, micro, w.local_ranks)
    else:  # what the step timed is read again after each stage: the sweep adds its sizes
        micro, probed, speed = batch.probed_micro_batch(timed, w.shape, per_rank, w.n_train, w.max_length, w.device,
                                                        w.local_ranks, budget, w.known, timed.of_kernel(timed.model))
        micro, rows, speed = trained_faster(micro, [Decision(*r) for r in probed], speed, key, per_rank, w.n_train,
                                            timed.of_kernel(timed.model))
    if speed is None:  # the attention pick may have timed that very step
        speed = timed.of_kernel(timed.model).get(micro, (None,))[0]
    return MicroBatch(micro, tuple(rows), speed, key)


def trained_faster(micro: int, rows: list[Decision], speed: float | None, key: Key, per_rank: int, n_train: int,
                   seen: dict[int, tuple[float, float, float]]) -> tuple[int, list[Decision], float | None]:
    """The micro batch chosen, unless earlier runs of this shape on this machine trained it and another size that
    divides the effective batch, and the other trained faster beyond their noise: at least two runs at each size,
    the other's median 5% or more above, and its slowest run above the chosen size's fastest (what whole runs
    trained, optimizer step, data and padding in it, beats a probe's forward and backward). Then the other, its row
    saying so. One run a size is not enough: on a 2-core AVX512-BF16 VM one compare's runs at micro 2 trained 1.11x
    micro 4's, and the next compare, switched to micro 2 by it, trained 0.72x the hand-picked micro 4 (2026-12-02)."""
    from tunebench.training import plancheck

    runs = {m: r for m, v in plancheck.learned(plancheck.trained_key(key)).items()
            if (r := plancheck.runs_of(v)) and m in micro_candidates(per_rank, 1, n_train)}
    if micro not in runs:
        return micro, rows, speed
    median = {m: statistics.median(r) for m, r in runs.items()}
    faster = max(median, key=median.get)
    ratio = median[faster] / median[micro]
    if ratio < 1.05:
        return micro, rows, speed
    if min(len(runs[faster]), len(runs[micro])) < 2 or min(runs[faster]) <= max(runs[micro]):
        why = (f"{rows[0].reason}; kept over micro {faster}, which trained {ratio:.2f}x it on this machine "
               f"({plancheck.spread(runs[faster])} against {plancheck.spread(runs[micro])} positions/s): "
               + ("one run is within a run's noise" if min(len(runs[faster]), len(runs[micro])) < 2
                  else "their runs overlap"))
        return micro, [Decision("micro_batch_size", micro, why), *rows[1:]], speed
    why = (f"trained fastest on this machine: {median[faster]:,.0f} positions/s at micro {faster} "
           f"({plancheck.spread(runs[faster])} in {len(runs[faster])} runs), {ratio:.2f}x the {median[micro]:,.0f} "
           f"at micro {micro} ({plancheck.spread(runs[micro])}), which the probe picked ({rows[0].reason})")
    return faster, [Decision("micro_batch_size", faster, why), *rows[1:]], \
        seen.get(faster, (speed * ratio if speed else None,))[0]


class Timed:
    """A probe step that remembers what it measured, by attention kernel and micro batch: the attention pick
    times a step at the micro batch it measures at, and the batch sweep takes that size's figure for the kernel
    kept instead of timing the same step again."""

    def __init__(self, model, step):
        self.model, self.step = model, step
        self.seen: dict[tuple[str, int], tuple[float, float, float]] = {}  # -> best tokens/s, its peak MB, seconds

    def __call__(self, size: int) -> tuple[float, float]:
        start = time.perf_counter()
        tokens_per_s, peak = self.step(size)
        key = (self.kernel(self.model), size)
        if tokens_per_s > self.seen.get(key, (0.0,))[0]:
            self.seen[key] = (tokens_per_s, peak, time.perf_counter() - start)
        return tokens_per_s, peak

    @staticmethod
    def kernel(model) -> str:
        from tunebench.model import methods
        return str(getattr(methods.base_of(model).config, "_attn_implementation", ""))

    def of_kernel(self, model) -> dict[int, tuple[float, float, float]]:
        """{micro batch: (tokens/s, peak MB, seconds)} timed with the kernel the model runs now."""
        kernel = self.kernel(model)
        return {size: v for (k, size), v in self.seen.items() if k == kernel}


def make(hw_plan, world, parallel: Decision, measured: Measured, effective: int, accum: int, steps: int,
         rows: list[Decision]) -> RunPlan:
    """The frozen plan of a run from its parts; `rows` is the settings table in print order."""
    return RunPlan(hw_plan.device, hw_plan.precision, hw_plan.threads, world.size, str(parallel.value),
                   measured.attention, measured.micro_batch_size, accum, effective, steps, measured.compiled,
                   measured.tokens_per_s, tuple(Decision(*r) for r in rows))


def logging_row(asked: int | None, device_type: str) -> Decision:
    if asked:
        return Decision("logging_steps", asked, "logging.logging_steps")
    if device_type in ("cuda", "mps"):
        return Decision("logging_steps", 10, "every 10 steps: reading a loss makes the host wait for the GPU, so the "
                                             "loop keeps them on the device in between")
    return Decision("logging_steps", 1, "every step: on a CPU, reading the loss costs nothing")


def apply_measured(model, rows: list[Decision]) -> None:
    """Apply decisions rank 0 measured (its settings rows) to this rank's copy of the model, without
    measuring: the attention kernel, gradient checkpointing, compiled blocks."""
    from tunebench.model import kernels
    from tunebench.training.autotune.compiler import compile_blocks
    from tunebench.training.autotune.probe import enable_checkpointing

    for setting, value, _ in rows:
        if setting == "attention":
            kernels.register()
            model.set_attn_implementation(value)
        elif setting == "gradient_checkpointing" and value is True:
            enable_checkpointing(model)
        elif setting == "compile" and value is True:
            compile_blocks(model)
