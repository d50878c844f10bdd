"""The one contract between a training job and the runner. A job (jobs/finetune.py, grpo.py, pretrain.py) opens the
run, builds its model and data, and hands a Recipe to `run`, which does the rest once and reads top to bottom in
the order it happens: the steps the run takes, the measured settings (attention kernel, micro batch,
checkpointing, compile), the plan and its printed table, the objective, optimizer and schedule, the records, the
resume point, the optimizer steps (training.loop.optimizer_steps, called from `run` itself) with their evaluations
and checkpoints, then, on rank 0, the job's outputs and summary, summary.json, the closing lines and the
trackers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tunebench.core import startup
from tunebench.core.decision import Decision
from tunebench.core.jsonfile import write_json
from tunebench.core.precision import DTYPES
from tunebench.jobs.parts import measuring, runner
from tunebench.machine import distributed, trackers
from tunebench.machine.metrics import MetricsWriter, peak_memory_mb, reset_peak_memory
from tunebench.machine.monitor import CoreShare, Monitor, other_load
from tunebench.settings import objectives
from tunebench.settings.rundir import RunDir
from tunebench.settings.schema import RunBase
from tunebench.training import checkpoint, feed, loop, optim, plancheck, runplan, stopping
from tunebench.training import objective as objective_
from tunebench.training import summary as summary_
from tunebench.training.autotune import compiler, memory
from tunebench.training.autotune.probe import memory_free_mb, probe_step
from tunebench.training.loop import Hooks, LoopSettings, LoopState
from tunebench.training.objective import Batch


@dataclass(frozen=True)
class Finished:
    """What a recipe's `finish` gets on rank 0 once the loop has ended: the plan it ran, the loop's outcome, a
    sharded model's gathered weights (None when whole) and the seconds the measurements took."""

    plan: runplan.RunPlan
    outcome: summary_.Outcome
    weights: dict | None
    measure_s: float
    ranks: list[Any] | None = None  # each rank's Recipe.rank_figures(), in rank order (None: it has none)


@dataclass
class Recipe:
    """What one objective trains, as the runner needs it: its model and loss, what its units are (runplan.Units,
    for the measurement and the plan), its rows in the table, how it batches and evaluates, and what it does at
    the end."""

    model: torch.nn.Module
    loss: torch.nn.Module | None  # None: the next-token loss over the rows (runner.objective builds it)
    units: runplan.Units
    method_rows: list[Decision]  # below the world and parallel rows: the method's, the objective's
    header: str  # printed above the settings table: the model, the data and what trains
    parallel: Decision
    batches: Callable[[int], feed.Batches]  # micro batch -> how the micro batches are made
    eval_sets: Callable[[int], list[tuple[str, list[Batch]]]]  # micro batch -> the held-out batches, by name
    identity: dict[str, Any]  # what a resume must match
    finish: Callable[[Finished], tuple[dict[str, Any], list[Path]]]  # rank 0: (summary, files saved)
    publish: Callable[..., None]  # the trackers' end of the run (jobs.run_report.send: a layer above this one)
    records: dict[str, Any] = field(default_factory=dict)  # plan.json's extra fields
    rows: list[Decision] = field(default_factory=list)  # the model's rows, below the host's
    before_training: Callable[[runplan.RunPlan], None] | None = None  # after the table, before the loop
    after_eval: Callable[[runplan.RunPlan, int], dict[str, Any]] | None = None
    rank_figures: Callable[[], Any] | None = None  # what each rank counted itself, gathered for `finish`
    # the objective's type: how its evaluation reads in words (pretraining's is the next-token loss's, SFT's)
    objective: objectives.ObjectiveBase = field(default_factory=objectives.SFT)


def resumed_steps(opened: runner.Opened) -> int | None:
    """The total steps the run being resumed planned (its plan.json), or None for a run from step 0."""
    if opened.resume_from is None:
        return None
    for plan_file in (RunDir(opened.out).plan_file, RunDir(opened.resume_from.parent.parent).plan_file):
        if plan_file.is_file():
            rows = json.loads(plan_file.read_text()).get("decisions", [])
            return next((int(d["value"]) for d in rows if d["setting"] == "total_steps"), None)
    return None


def run(cfg: RunBase, opened: runner.Opened, r: Recipe) -> dict[str, Any]:
    """One run of `r`, in four stages: plan it (the steps, the measured settings, the plan and its table), build its
    trainer (the objective as the process group wraps it, the optimizer, the schedule), train (the optimizer steps
    of training.loop.optimizer_steps with their evaluations and checkpoints, inside `training`: the records, the
    resume point and the evaluation before them, the last checkpoint and the evaluation after), then, on rank 0,
    finish (the job's outputs, summary.json and the trackers). Returns the summary on rank 0, {} on the other ranks.

    Ctrl-C or SIGTERM finishes the current step and saves a resumable checkpoint (a second Ctrl-C aborts; see
    stopping.StopRequest); under several ranks a signal to any one stops all of them at the same step. Only rank 0
    writes records and talks; every rank runs the rest (evaluation and saving are collectives)."""
    planned = plan_run(cfg, opened, r)
    stopping.raise_if_signalled()  # between stages: a stop whose raise was swallowed while planning
    if r.before_training:
        r.before_training(planned.plan)
    t = build_trainer(cfg, opened, r, planned)
    with runner.tracking(opened, cfg.logging) as tracking:  # closed with the run's outcome, whatever it is
        with training(cfg, opened, r, planned, t, tracking) as on:
            on.state = loop.optimizer_steps(t.objective, t.optimizer, t.scheduler, on.steps, on.state, t.settings,
                                            on.hooks, t.scaler)
        trained = on.result
        del t, on  # DDP's reducer holds the process group: freed now, not at interpreter exit (see shutdown)
        distributed.shutdown(opened.world)
        if not opened.world.main:
            return {}
        return finish(cfg, opened, r, planned, trained, tracking)


@dataclass(frozen=True)
class Planned:
    """What `plan_run` decided: the plan (its table printed), how the micro batches are made, the optimizer's
    settings, the memory the plan predicts for a step, and the seconds measuring took."""

    plan: runplan.RunPlan
    batches: feed.Batches
    optimization: runner.Optimization
    memory_plan: memory.MemoryPlan
    measure_s: float
    forecast: plancheck.Forecast
    measured: runplan.Measured
    time_limit_s: float | None = None  # --time-budget of a run whose steps sample: the loop's deadline


def plan_run(cfg: RunBase, opened: runner.Opened, r: Recipe) -> Planned:
    """The steps, the measured settings (measuring.decide), the batches for the micro batch chosen, the memory of a
    step, and the plan with its table, printed on rank 0."""
    world, device, effective, s = opened.world, opened.device, opened.effective, cfg.schedule
    extra = list(r.loss.parameters()) if r.loss is not None else []  # a full fine-tune's reference copy, say
    held = memory.held_mb(r.model, extra)
    startup.release_freed()  # what loading freed (an fp32 copy cast down) is not the run's
    runtime = max(0.0, memory.runtime_mb(device.type) - held)  # what the process holds beside the weights

    u = r.units
    steps = runplan.total_steps(u.n, effective, s.epochs, s.max_steps, s.max_tokens, u.tokens_each)
    probe = probe_step(r.model, u.probe_rows, device, opened.autocast, r.loss)
    value_bytes = DTYPES[opened.hw_plan.precision].itemsize
    measured, measure_s = measuring.decide(opened, cfg, r.model, probe, u, steps * effective * u.tokens_each, r.parallel,
                                           probe_peak(r, extra, runtime, value_bytes, device.type))
    per_step = effective * u.tokens_each / world.size  # the tokens one rank computes in a step
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    made = r.batches(micro)
    speed = None if made.sampled else measured.tokens_per_s  # a step that samples is not the probe's speed
    time_limit_s = None
    if not made.sampled:
        steps, budget_row = distributed.agree(world, lambda: runplan.fit_time(  # rank 0's clock: every rank the same
            s.time_budget, steps, per_step, speed, measure_s, resumed_steps(opened) if s.time_budget else None),
            safe=(Decision,))
    else:  # its steps sample: the budget a deadline the loop keeps
        steps = (resumed_steps(opened) if s.time_budget else None) or steps
        time_limit_s, budget_row = distributed.agree(world, lambda: runplan.sampling_budget(
            s.time_budget, steps, measure_s), safe=(Decision,))
    optimization, lr_row = runner.learning_rate(cfg, effective, steps)
    packed = any(d.setting == "batch layout" and d.value == "packed" for d in made.rows)
    # the rows a unit collates into (a preference pair: chosen and rejected; a GRPO group: its completions)
    rows_each = int(u.probe_rows(1)["input_ids"].shape[0])
    memory_plan = memory.of_step(r.model, extra, micro, u.widest if packed or u.longest is None else u.longest,
                                 value_bytes, measured.attention, runtime, device.type, rows_each, measured.compiled)
    work = plancheck.Work(0.0, 0.0)
    if not made.sampled:  # GRPO's are sampled during the step
        work = plancheck.planned_work(made.feed(world, micro, accum), steps, accum)
    if r.loss is not None and work.most_loss_positions:  # an objective of its own: log-probabilities held whole
        memory_plan = memory.with_logits(memory_plan, work.most_loss_positions, memory.vocab_of(r.model))
    if made.sampled:
        memory_plan = sampled_memory(r, memory_plan, effective // world.size * rows_each, value_bytes)
    if measured.key:  # what this machine's runs held beyond their plans
        memory_plan = memory.with_learned(memory_plan, plancheck.memory_beyond(plancheck.memory_key(measured.key)))
    started = time.perf_counter()
    forecast = forecast_of(r, work, opened, measured, steps, speed, memory_plan.total, made.sampled)
    measure_s += time.perf_counter() - started  # timing the optimizer step is measuring too
    estimate = runplan.estimate_row(forecast, measure_s)
    if estimate is None and made.sampled:
        estimate = Decision("time_estimate", "not yet", "its steps sample (GRPO, RFT), which no probe times: the "
                            "next run of this shape on this machine predicts from what this one takes a step")

    plan = runplan.make(opened.hw_plan, world, r.parallel, measured, effective, accum, steps, [
        *runner.host_rows(cfg, opened.hw_plan), *r.rows, Decision("world", world.size, world.describe()), r.parallel,
        *r.method_rows,
        *[d for d in measured.decisions if d.setting != "compile"], *made.rows,
        *[d for d in measured.decisions if d.setting == "compile"], optim.optimizer_row(device, optimization.weight_decay),
        runplan.batch_row(effective, micro, accum, world.size, u.batch_unit),
        memory.row(memory_plan, memory_free_mb(device, world.local_size), device.type), lr_row,
        runplan.logging_row(cfg.logging.logging_steps, device.type),
        budget_row or runner.steps_row(cfg, steps, f"{u.n} {u.name}, {effective} a step"),
        *([estimate] if estimate else [])])
    if made.sampled:
        plan = dataclasses.replace(plan, probed_tokens_per_s=None)
    if world.main:
        print(r.header)
        summary_.print_plan(plan.decisions)
    return Planned(plan, made, optimization, memory_plan, measure_s, forecast, measured, time_limit_s)


def probe_peak(r: Recipe, extra: list, runtime: float, value_bytes: int, device_type: str) \
        -> Callable[[str, int], float]:
    """(kernel, units) -> the memory plan's peak MB of a probe step of `units` of the widest units with that kernel,
    counted as the run's plan is (memory.of_step, and an objective's log-probabilities at the batch's loss
    positions), recomputation as the model stands when asked: what the attention pick holds its first kernel to."""
    @functools.lru_cache(maxsize=4)
    def rows(units: int) -> tuple[int, int, int]:
        batch = r.units.probe_rows(units)
        n, width = batch["input_ids"].shape
        return int(n), int(width), plancheck.loss_positions(batch) if r.loss is not None else 0

    def peak(kernel: str, units: int) -> float:
        n, width, positions = rows(units)
        plan = memory.of_step(r.model, extra, units, width, value_bytes, kernel, runtime, device_type, n // units)
        return (memory.with_logits(plan, positions, memory.vocab_of(r.model)) if positions else plan).total

    return peak


def sampled_memory(r: Recipe, plan: memory.MemoryPlan, episodes: int, value_bytes: int) -> memory.MemoryPlan:
    """The memory plan of a step that samples (GRPO, RFT): its loss's log-probabilities at the loss positions of
    the widest rows the probe ran (every completion as long as it can be), which `planned_work` cannot count from
    batches not yet drawn, and the KV caches of its `episodes` decoded at once."""
    widest = r.units.probe_rows(plan.micro // plan.rows_each)
    if r.loss is not None:
        plan = memory.with_logits(plan, plancheck.loss_positions(widest), memory.vocab_of(r.model))
    return memory.with_sampling(plan, memory.shape_of(r.model), episodes, value_bytes)


def forecast_of(r: Recipe, work: plancheck.Work, opened: runner.Opened, measured: runplan.Measured, steps: int,
                speed: float | None, peak_mb: float, sampled: bool) -> plancheck.Forecast:
    """What the plan predicts of the loop: the run's own batches counted (not GRPO's, which are sampled during the
    step), at the speed the last run of this shape trained at, else the probe's with an optimizer step timed on
    rank 0 (corrected by the machine's record of such figures against runs), with the first steps' extra."""
    world = opened.world
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    if sampled:  # GRPO's steps sample: what the last run of the shape took a step, or nothing
        learned = plancheck.learned(plancheck.step_key(measured.key)) if measured.key else {}
        return plancheck.step_forecast(work, micro, learned, steps, peak_mb, world.size)
    if not speed:
        work = plancheck.Work(0.0, 0.0)
    learned = plancheck.learned(plancheck.trained_key(measured.key)) if measured.key and speed else {}
    ratio = plancheck.probe_ratio(plancheck.machine_key(measured.key), micro) if measured.key else None
    probe_from, probe = "the probe's forward and backward at the widest rows", None
    if speed and work.positions and steps and micro not in learned and world.main:
        trainable = sum(p.numel() for p in r.model.parameters() if p.requires_grad)
        speeds = dict(measured.speeds)
        at_micro = speeds.get(micro, speed)  # the widest rows' speed at the run's micro batch

        def on_record() -> plancheck.CallCost | None:
            return None if measured.compiled else plancheck.record_cost(
                micro, at_micro, dict(measured.record_ratios), r.units.probe_rows, measured.record_source)

        def narrow() -> plancheck.CallCost | None:
            return narrow_cost(r, opened, measured, at_micro, work)

        # A record of the run's own shape before one more probe: that probe's first calls at a new width cost more
        # than its budget counts. In the README's compare on a 2-core Xeon auto measured 2.4 and 5.7 s longer than
        # the hand-picked rows where it took the probe (trained 1.12x and 0.93x its plan), as long where it took
        # the record (0.93x and 0.99x) (2026-12-04, benchmarks/first-run-xeon-2026-12-04)
        first, then = (on_record, narrow) if measured.record_same_shape else (narrow, on_record)
        calls = plancheck.call_cost(speeds, r.units.probe_rows, micro) or first() or then()
        probe, probe_from = plancheck.with_optimizer(speed, work, steps, plancheck.optimizer_step_s(
            trainable, opened.device), calls)
    f = plancheck.forecast(work, micro, probe or speed, learned, micro in measured.timed, measured.first_steps,
                           steps * accum, peak_mb, world.size, ratio if probe else None, probe_from)
    return dataclasses.replace(f, probe_positions_per_s=probe)


NARROW = 0.85  # the run's micro batches are timed at their own width where they average less of the probe's
NARROW_SHARE = 0.1  # and where that costs at most this share of the training it predicts (measuring's budget)


def narrow_cost(r: Recipe, opened: runner.Opened, measured: runplan.Measured, wide_speed: float,
                work: plancheck.Work) -> plancheck.CallCost | None:
    """What one of the run's micro batches costs at its own width where the probe timed only its micro batch
    (asked for, or the one size a sweep ran) at the widest rows: one more probe, of rows as wide as the run's
    micro batches are on average, where those are narrower than NARROW of the probe's and it costs at most
    NARROW_SHARE of the training. Not compiled blocks: a new width would compile them again. A micro-1 run on a
    2-core Intel Xeon trained at 0.70-0.92x its widest-row probe in 8 of 9 compares (2026-12-03)."""
    micro, u = measured.micro_batch_size, r.units
    if u.rows_near is None or measured.compiled or not work.micro_batches:
        return None
    wide = u.probe_rows(micro)
    rows, positions = wide["input_ids"].shape[0], wide["input_ids"].numel()
    mean = work.positions / work.micro_batches
    if mean >= NARROW * positions:
        return None
    narrow = u.rows_near(micro, round(mean / rows))
    if 3 * narrow["input_ids"].numel() > NARROW_SHARE * work.positions:  # a probe is 3 calls, about as fast
        return None
    narrow_speed, _ = probe_step(r.model, lambda size: narrow, opened.device, opened.autocast, r.loss)(micro)
    return plancheck.width_cost(micro, wide, wide_speed, narrow, narrow_speed)


@dataclass
class Trainer:
    """What trains: the objective as the process group wraps it (and the module evaluation runs through), the
    optimizer over the parameters FSDP sharded, the schedule, fp16's GradScaler, and the loop's settings."""

    objective: torch.nn.Module
    eval_objective: torch.nn.Module
    split_eval: bool  # evaluation splits its batches over the ranks
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    identity: dict[str, Any]  # what a checkpoint records and a resume must match
    settings: LoopSettings
    eval_sets: list[tuple[str, list[Batch]]]  # the held-out batches, by name


def build_trainer(cfg: RunBase, opened: runner.Opened, r: Recipe, planned: Planned) -> Trainer:
    """The objective as the process group wraps it (DDP, FSDP), each rank's own dropout masks, the optimizer, the
    schedule, the loop's settings and the held-out batches, for `planned`'s plan."""
    world, device, plan = opened.world, opened.device, planned.plan
    objective, eval_objective, split_eval = runner.objective(r.model, opened.autocast, device, world, plan.parallel,
                                                             r.loss)
    if world.backend is not None:
        torch.manual_seed(opened.seed + world.rank)
    optimization = planned.optimization
    optimizer = optim.adamw(r.model, optimization.lr, optimization.weight_decay, device, optimization.betas)
    scheduler = optim.scheduler(optimizer, optimization.schedule, optimization.warmup_steps, plan.total_steps)
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None
    identity = r.identity | {"rows_per_micro_step": plan.micro_batch_size * world.size,
                             "grad_accum_steps": plan.grad_accum_steps}
    o, lg = cfg.output, cfg.logging
    settings = LoopSettings(
        total_steps=plan.total_steps, grad_accum_steps=plan.grad_accum_steps, max_grad_norm=optimization.max_grad_norm,
        device=device, logging_steps=int(plan.value("logging_steps")),
        eval_steps=runner.every(cfg.evaluation.eval_steps, plan.total_steps), save_steps=o.save_steps,
        progress=lg.progress, pin_memory=bool(plan.value("pin_memory")), world=world,
        time_limit_s=planned.time_limit_s)
    return Trainer(objective, eval_objective, split_eval, optimizer, scheduler, scaler, identity, settings,
                   r.eval_sets(plan.micro_batch_size))


@dataclass(frozen=True)
class TrainResult:
    """What `train` leaves for `finish`: the loop's outcome, a sharded model's gathered weights and each rank's own
    figures (Recipe.rank_figures)."""

    outcome: summary_.Outcome
    weights: dict | None
    ranks: list[Any] | None
    times: list[tuple[float, int, int]] = field(default_factory=list)  # this process's steps: seconds, positions, tokens
    largest_fed: tuple[int, int, int] = (0, 0, 0)  # the micro batch of most positions the loop fed: rows, width;
    # and the most loss positions one held


class Largest:
    """A collate that keeps the micro batch of most positions it made (rows, width): what the memory plan is held
    to at the end (GRPO plans every group teaching, and feeds only the groups that teach)."""

    def __init__(self, collate: Callable):
        self.collate, self.rows, self.width, self.loss_positions = collate, 0, 0, 0

    def __call__(self, *args):
        batch = self.collate(*args)
        rows, width = batch["input_ids"].shape
        if rows * width > self.rows * self.width:
            self.rows, self.width = rows, width
        # the most loss positions one held: its log-probabilities' share of the peak
        self.loss_positions = max(self.loss_positions, plancheck.loss_positions(batch))
        return batch


def _watchers(opened: runner.Opened, monitor: bool, plan: runplan.RunPlan, tracking: trackers.Tracking, log: Callable,
              warmup: int) -> tuple[Monitor, Callable[[int, float, int], None]]:
    """The system monitor (monitor.jsonl, the trackers' system metrics) and, on rank 0, the watch that says when the
    steps slow down against the probe (runner.SlowdownWatch)."""
    world, device = opened.world, opened.device
    sampler = Monitor(opened.out / "monitor.jsonl" if monitor and world.main else None,
                      gpu_indices=(device.index or 0,) if device.type == "cuda" else (),
                      sink=tracking.system if world.main else None)
    if not world.main:
        return sampler, lambda step, seconds, positions: None
    return sampler, runner.SlowdownWatch(plan.probed_tokens_per_s, other_load,
                                         torch.get_num_threads() * world.local_size, log, warmup)


@dataclass
class Training:
    """What the optimizer steps start from (`training` makes it; the loop's call is `run`'s): the steps, the state
    (the resume point; the loop's end state put back), the hooks; and, once `training` is done, its result."""

    steps: feed.Steps
    state: LoopState
    hooks: Hooks
    result: TrainResult | None = None


@contextlib.contextmanager
def training(cfg: RunBase, opened: runner.Opened, r: Recipe, planned: Planned, t: Trainer,
             tracking: trackers.Tracking) -> Iterator[Training]:
    """Around the optimizer steps: before them the records (rank 0: config.yaml and plan.json, the trackers'
    parameters), the resume point, the evaluation before, the signals taken over (a stop saves a checkpoint);
    after them the last checkpoint, the evaluation after, and what every rank must gather before the process group
    closes (the peaks, a sharded model's weights, each rank's figures), left in the Training's `result`."""
    world, device, plan, o, lg = opened.world, opened.device, planned.plan, cfg.output, cfg.logging
    if world.main:
        tracking.start(trackers.params_of(*runner.records(opened, cfg, plan, **r.records)()))
    startup.done()  # the libraries and the model are in: collection resumes, with them frozen
    state = LoopState()
    if opened.resume_from:
        state = checkpoint.load(opened.resume_from, r.model, t.optimizer, t.scheduler, t.identity, t.scaler, world)
        runner.say(world, f"resume: continuing from {opened.resume_from} (step {state.step})")
    metrics = MetricsWriter(opened.out / "metrics.jsonl", tracking.log) if world.main else None
    log = metrics or (lambda record: None)
    stop = stopping.StopRequest(world.rank if world.backend else None)
    eval_sets = t.eval_sets

    def save(at: LoopState) -> None:
        path = checkpoint.save(opened.out / "checkpoints", r.model, t.optimizer, t.scheduler, at, t.identity,
                               o.save_total_limit, t.scaler, world)
        log({"step": at.step, "checkpoint": str(path)})

    def evaluate(step: int) -> dict[str, Any]:  # each of eval_sets (several: combined by runner.per_source)
        with compiler.eagerly(plan.compile):
            record = runner.per_source([(name, objective_.evaluate(t.eval_objective, batches, device, world, t.split_eval))
                                        for name, batches in eval_sets])
        return record | (r.after_eval(plan, step) if r.after_eval else {})

    has_eval = any(batches for _, batches in eval_sets)
    sampler, watch = _watchers(opened, lg.monitor, plan, tracking, log, t.settings.warmup_steps_excluded)
    times: list[tuple[float, int, int]] = []  # each step: seconds, this rank's positions, all ranks' real tokens

    def step_done(step: int, seconds: float, positions: int, tokens: int) -> None:
        times.append((seconds, positions, tokens))
        watch(step, seconds, positions)

    hooks = Hooks(log=log, evaluate=evaluate if has_eval else None, save=save,
                  should_stop=lambda: stop.requested, step_done=step_done)

    before = evaluate(0) if has_eval and state.step == 0 else None
    if before:
        log({"step": 0, **before})
        runner.say(world, f"eval before training: {r.objective.describe_eval(before)}")
    made = planned.batches
    on = Training(made.feed(world, plan.micro_batch_size, plan.grad_accum_steps, largest := Largest(made.collate)),
                  state, hooks)
    stopping.raise_if_signalled()  # the last look before the loop takes the signals over
    old = {sig: signal.signal(sig, stop.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopping.Phase.loop_started = True
    wall, cores = time.perf_counter(), CoreShare(torch.get_num_threads(), world.local_size) if device.type == "cpu" else None
    try:
        try:
            reset_peak_memory(device)  # the summary's peak is the loop's, not a probe's or the loading's
            with sampler:
                yield on
            state = on.state
            if not (o.save_steps and state.step % o.save_steps == 0):  # the loop did not just save it
                save(state)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        wall, shared = time.perf_counter() - wall, cores.shared() if cores else None  # others' share of the cores
        peaks = distributed.gather(world, peak_memory_mb(device)) or [0.0]
        after = evaluate(state.step) if has_eval else {}
        if after:
            log({"step": state.step, **after})
    finally:
        if metrics:
            metrics.close()
    outcome = summary_.Outcome(state, wall, before, after, sampler.summary(), max(peaks), sum(peaks),
                             t.settings.warmup_steps_excluded, shared)
    weights = distributed.full_weights(r.model, world) if plan.parallel == "fsdp" else None
    ranks = distributed.gather(world, r.rank_figures()) if r.rank_figures else None
    on.result = TrainResult(outcome, weights, ranks, times, (largest.rows, largest.width, largest.loss_positions))


def finish(cfg: RunBase, opened: runner.Opened, r: Recipe, planned: Planned, trained: TrainResult,
           tracking: trackers.Tracking) -> dict[str, Any]:
    """Rank 0: the job's outputs and summary (Recipe.finish), summary.json, the closing lines, the trackers."""
    summary, saved = r.finish(Finished(planned.plan, trained.outcome, trained.weights, planned.measure_s, trained.ranks))
    summary.update(tracking.costs())
    summary["memory_plan_mb"] = round(planned.memory_plan.total, 1)  # beside the measured peak_memory_mb
    o, forecast = trained.outcome, planned.forecast
    if planned.time_limit_s is not None and o.state.step < planned.plan.total_steps:
        print(f"--time-budget {cfg.schedule.time_budget}: the run ended after step {o.state.step} of at most "
              f"{planned.plan.total_steps}, the first to finish past {planned.time_limit_s:.0f} s of training")
    # resumed, or ended by its time budget: the prediction for the steps this process ran
    if trained.times and len(trained.times) < planned.plan.total_steps:
        share = len(trained.times) / planned.plan.total_steps
        forecast = dataclasses.replace(forecast, work=plancheck.Work(forecast.work.positions * share,
                                                                     forecast.work.tokens * share),
                                       steps=len(trained.times))
    rows, width, loss_positions = trained.largest_fed
    plan_ = planned.memory_plan
    # the plan a bound where steps sample (GRPO leaves out the groups that teach nothing, RFT the unkept rows): held
    # also to the largest micro batch fed; a supervised run's plan is at its longest rows, which it feeds in an epoch
    sampled = planned.batches.sampled
    bound = sampled and 0 < rows * width < 0.9 * plan_.micro * plan_.tokens
    fed = (rows, width, plan_.as_fed(rows, width, loss_positions)) if bound else None
    check = plancheck.check(forecast, trained.times, o.wall_s, o.peak_memory_mb, fed, sampled=sampled,
                            cores_shared=o.cores_shared)
    summary["plan_check"] = check
    write_json(opened.out / "summary.json", summary)
    summary_.report(summary, opened.out, r.objective)
    print("\n".join(plancheck.lines(check)))
    m = planned.measured
    if m.key:
        plancheck.learn_memory(plancheck.memory_key(m.key), check, plan_.learned)
    if m.key and not plancheck.shared_too_much(check):  # a loaded machine's speed is not the shape's
        if sampled:  # GRPO's steps also sample: what a step took, not a speed, teaches the next run
            plancheck.learn_steps(plancheck.step_key(m.key), m.micro_batch_size, check)
        elif planned.forecast.positions_per_s:
            warm = m.micro_batch_size in m.timed
            plancheck.learn(plancheck.trained_key(m.key), m.micro_batch_size, check, warm,
                            m.tokens_per_s if warm else None)
            plancheck.learn_ratio(plancheck.machine_key(m.key), check, planned.forecast.probe_positions_per_s,
                                  m.micro_batch_size)
    r.publish(tracking, summary, opened.out, saved if cfg.logging.log_model else [])
    return summary
