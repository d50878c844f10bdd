"""What every training job does around the loop: the output directory, the settings table, signals,
checkpoints and resume, the monitor, evaluation before and after, and the run's summary figures.

A job builds its model, data and decisions, then hands them here; the loop itself is loop.train.
"""

from __future__ import annotations

import math
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import checkpoint, distributed, hardware, models
from tunebench.distributed import World
from tunebench.errors import TunebenchError
from tunebench.loop import Batch, CausalLMLoss, Hooks, LoopSettings, LoopState, train
from tunebench.metrics import MetricsWriter, mfu, peak_memory_mb, reset_peak_memory
from tunebench.monitor import Monitor, other_load

Row = tuple[str, Any, str]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_plan(rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows)
    value_width = min(22, max(len(str(r[1])) for r in rows))
    print("settings:")
    for setting, value, reason in rows:
        print(f"  {setting:<{width}}  {value!s:<{value_width}}  {reason}")


def prepare_output_dir(path: Path, resume: str | None, overwrite: bool) -> None:
    """Check the output directory is writable, and never silently replace an earlier run in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TunebenchError(f"cannot write to --output-dir '{path}' ({e.strerror}); pick a writable directory") from e
    earlier = [p for p in (path / "checkpoints", path / "metrics.jsonl", path / "summary.json") if p.exists()]
    if not earlier or resume:
        return
    if not overwrite:
        raise TunebenchError(
            f"--output-dir '{path}' already holds a run ({earlier[0].name}); continue it with --resume auto, "
            "replace it with --overwrite, or pick another --output-dir"
        )
    for p in earlier:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def open_run(world: World, out: Path, resume: str | None, overwrite: bool, identity: dict[str, Any]) -> Path | None:
    """prepare_output_dir and resume_point, on rank 0 only (the others must not delete or create the same
    files); every rank gets the checkpoint to resume from, or the same refusal."""
    def check() -> Path | None:
        prepare_output_dir(out, resume, overwrite)
        return resume_point(resume, out, identity)

    return distributed.agree(world, check)


def resume_point(resume: str | None, out: Path, identity: dict[str, Any]) -> Path | None:
    """The checkpoint to continue from, checked before anything expensive: a path that is not a checkpoint,
    or one made with other settings (`identity`: those known before the model loads), is refused here."""
    if not resume:
        return None
    found = checkpoint.find(resume, out / "checkpoints")
    if found is None:
        print(f"resume: no checkpoint under {out / 'checkpoints'}; starting from step 0")
        return None
    checkpoint.check_identity(found, identity)
    return found


def micro_batches(order: Callable[[int], list[list[int]]], collate: Callable[[list[int]], Batch], world: World,
                  micro_batch_size: int) -> Callable[[LoopState], Batch]:
    """The loop's `next_micro_batch`. `order(epoch)` lists the epoch's global micro-steps (micro batch x
    world size rows each, a pure function of seed and epoch); this rank collates its share. A short last
    step can leave a rank no rows: it gets a filler row with no loss and no real tokens, because every
    rank must run the same number of forward/backward passes for the gradient sync."""
    epochs: dict[int, list[list[int]]] = {}

    def next_micro_batch(s: LoopState) -> Batch:
        steps = epochs.setdefault(s.epoch, order(s.epoch))
        if s.batch_in_epoch >= len(steps):
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
            return next_micro_batch(s)
        rows = steps[s.batch_in_epoch]
        s.batch_in_epoch += 1
        mine = distributed.shard(rows, world, micro_batch_size)
        if mine:
            return collate(mine)
        filler = collate(rows[:1])
        return {**filler, "labels": torch.full_like(filler["labels"], -100),
                "attention_mask": torch.zeros_like(filler["attention_mask"])}

    return next_micro_batch


def total_steps(rows: int, micro_batch_size: int, grad_accum_steps: int, world: World, epochs: float,
                max_steps: int | None, max_tokens: int | None = None, tokens_per_row: float = 1.0) -> int:
    """Optimizer steps of a run: `max_steps`; else the steps whose rows hold about `max_tokens` real tokens
    (`tokens_per_row` on average), so runs with different batch sizes see the same data; else `epochs`
    over `rows`, counted in global micro-steps (micro batch x world size rows each)."""
    if max_steps:
        return max_steps
    if max_tokens:
        return max(1, round(max_tokens / (micro_batch_size * grad_accum_steps * world.size * tokens_per_row)))
    micro_steps = math.ceil(rows / (micro_batch_size * world.size))
    return max(1, math.ceil(epochs * micro_steps / grad_accum_steps))


def every(steps: float | None, total: int) -> int | None:
    """`eval_steps` as a step count: N steps, or below 1 that share of the run's `total` steps (HF Trainer's rule)."""
    if steps is None:
        return None
    return max(1, round(steps * total)) if steps < 1 else int(steps)


def compile_decision(plan: hardware.Plan, parallel: str) -> hardware.Decision:
    """What compiler.pick is asked: the plan's, except under FSDP sharding, where it is off."""
    if parallel == "fsdp":
        return hardware.Decision("compile", False, "not combined with FSDP sharding here")
    return plan.decision("compile")


def resumed_batch(resume: Path | None, world: World, micro_asked: int | None,
                  accum_asked: int | None) -> tuple[int, int] | None:
    """(micro batch per rank, accumulation) that continue checkpoint `resume` under this world size: its
    rows per micro-step shared out over the ranks, so every optimizer step sees the same rows it would
    have. None when not resuming. A micro batch or accumulation asked for (None: auto) that differs
    is refused, not replaced."""
    if resume is None:
        return None
    made = checkpoint.check_identity(resume, {})["identity"]
    rows = made.get("rows_per_micro_step", made.get("micro_batch_size"))  # the latter: a single-process run's
    accum = made.get("grad_accum_steps")
    if not isinstance(rows, int) or not isinstance(accum, int):
        raise TunebenchError(f"checkpoint {resume} does not record its batch layout; resume from another "
                             "checkpoint or start a new --output-dir")
    if rows % world.size:
        raise TunebenchError(f"checkpoint {resume} took {rows} rows per micro-step, which {world.size} ranks cannot "
                             f"share evenly; resume with a number of processes that divides {rows}")
    micro = rows // world.size
    if (micro_asked not in (None, micro)) or (accum_asked not in (None, accum)):
        raise TunebenchError(f"checkpoint {resume} continues at micro batch {micro} x accumulation {accum} on "
                             f"{world.size} rank(s) ({rows} rows per micro-step); pass --batch-size {micro} (or "
                             "auto) and drop --grad-accum, or start a new --output-dir")
    return micro, accum


def apply_plan(plan: hardware.Plan) -> None:
    torch.set_num_threads(plan.threads)
    if plan.device == "cuda":
        tf32 = bool(plan.value("tf32"))
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = bool(plan.value("cudnn_benchmark"))


class SlowdownWatch:
    """Says once when the loop runs far slower than the probe measured on this machine, with the likely
    cause: OpenMP threads of two busy PyTorch processes on the same cores take turns (a LoRA run fell
    from 911 to 221 tokens/s beside another one), and that should not pass silently.

    Speed is counted in computed positions (padding included) over the last `window` steps, so padding
    does not read as a slowdown; with no probe figure, the run's own fastest window is the reference.
    """

    def __init__(self, expected: float | None, other_load: Callable[[int], tuple[float | None, str | None]],
                 threads: int, log: Callable[[dict[str, Any]], None], warmup: int = 2, window: int = 5,
                 ratio: float = 0.5):
        self.expected, self.other_load, self.threads, self.log = expected, other_load, threads, log
        self.warmup, self.window, self.ratio = warmup, window, ratio
        self.recent: list[tuple[float, int]] = []
        self.best_own = 0.0
        self.warned = False

    def __call__(self, state: LoopState, seconds: float, positions: int) -> None:
        if self.warned or state.step <= self.warmup:
            return
        self.recent = (self.recent + [(seconds, positions)])[-self.window:]
        if len(self.recent) < self.window:
            return
        speed = sum(p for _, p in self.recent) / sum(t for t, _ in self.recent)
        reference = self.expected or self.best_own
        self.best_own = max(self.best_own, speed)
        if not reference or speed >= self.ratio * reference:
            return
        self.warned = True
        source = "the probe measured on this machine" if self.expected else "this run reached earlier"
        others, busiest = self.other_load(self.threads)
        if others is not None and others >= 0.5:
            cause = (f"other processes want {others:.1f} CPUs beside this run's {self.threads} threads (load "
                     f"average {others + self.threads:.1f}" + (f"; busiest: {busiest}" if busiest else "")
                     + "): stop them, or give each run fewer --threads")
        else:
            cause = ("no other process is busy" + (f" (load average {others + self.threads:.1f} for "
                                                    f"{self.threads} threads)" if others is not None else "")
                     + ": look for thermal throttling, swapping, or a noisy neighbour on a shared host")
        message = (f"slowdown: the last {self.window} steps ran at {speed:,.0f} positions/s, "
                   f"{100 * speed / reference:.0f}% of the {reference:,.0f} {source}; {cause}")
        print(f"\nwarning: {message}")
        self.log({"step": state.step, "warning": message})


@dataclass
class Outcome:
    state: LoopState
    wall_s: float  # the training loop's wall time
    before: dict[str, float] | None  # eval before training (fresh runs only)
    after: dict[str, float]
    monitor: dict[str, float]
    peak_memory_mb: float  # of the training loop, the largest of any rank
    peak_memory_mb_total: float  # summed over ranks (on one machine: what the run costs it)


def objective(model, autocast_dtype, device: torch.device, world: World, parallel: str):
    """(module the loop trains through, module evaluation runs through, whether evaluation splits the
    batches over ranks). One process: the plain CausalLMLoss. DDP: wrapped for training; evaluation
    runs the unwrapped copy, each rank a share. FSDP: sharded before the optimizer is built (it
    replaces the parameters); its forward gathers weights, so every rank evaluates every batch."""
    loss = CausalLMLoss(model, autocast_dtype)
    if world.backend is None:
        return loss, loss, False
    if parallel == "fsdp":
        distributed.shard_fsdp(loss, model, world, device)
        return loss, loss, False
    return distributed.wrap_ddp(loss, world, device), loss, True


def run_loop(out: Path, model, objective_, optimizer, scheduler, scaler,
             next_micro_batch: Callable[[LoopState], Batch | None],
             evaluate: Callable[[], dict[str, float]] | None, settings: LoopSettings, identity: dict[str, Any],
             resume: Path | None, save_total_limit: int, report_to: str = "none", monitor: bool = True,
             after_eval: Callable[[int], dict[str, Any]] | None = None,
             probed_tokens_per_s: float | None = None) -> Outcome:
    """Resume from checkpoint `resume` (see resume_point) if given, evaluate, train `objective_` (from
    `objective`) to `settings.total_steps` with checkpoints, evaluate again.

    Ctrl-C or SIGTERM finishes the current step and saves a resumable checkpoint (a second one
    aborts); under several ranks, a signal to any one stops all of them at the same step.
    `after_eval(step)` adds fields to each eval record (sample generations, say).
    `probed_tokens_per_s`, what the probe measured for this micro batch, is what the loop's speed is
    watched against (see SlowdownWatch). Only rank 0 writes records and talks; every rank runs the
    rest (evaluation and saving are collectives).
    """
    world = settings.world
    state = LoopState()
    ckpt_root = out / "checkpoints"
    if resume:
        state = checkpoint.load(resume, model, optimizer, scheduler, identity, scaler, world)
        say(world, f"resume: continuing from {resume} (step {state.step})")
    metrics = MetricsWriter(out / "metrics.jsonl", out / "tensorboard" if report_to == "tensorboard" else None) \
        if world.main else None
    log = metrics or (lambda record: None)
    stop = {"requested": False, "at": 0.0}

    def on_signal(signum, frame):
        # torchrun passes the terminal's Ctrl-C on to its workers, which got it already: a repeat within a
        # second is the same request, not the second one that aborts.
        if stop["requested"] and time.monotonic() - stop["at"] > 1.0:
            raise KeyboardInterrupt
        if not stop["requested"]:
            stop["requested"], stop["at"] = True, time.monotonic()
            print(f"\n{signal.Signals(signum).name}" + (f" (rank {world.rank})" if world.backend else "")
                  + ": saving a checkpoint after this step (again to abort)")

    def save(s: LoopState):
        path = checkpoint.save(ckpt_root, model, optimizer, scheduler, s, identity, save_total_limit, scaler, world)
        log({"step": s.step, "checkpoint": str(path)})

    def run_eval(step: int) -> dict[str, Any]:
        record = dict(evaluate())
        if after_eval:
            record.update(after_eval(step))
        return record

    device = settings.device
    sampler = Monitor(out / "monitor.jsonl" if monitor and world.main else None,
                      gpu_indices=(device.index or 0,) if device.type == "cuda" else ())
    watch = SlowdownWatch(probed_tokens_per_s, other_load, torch.get_num_threads() * world.local_size, log,
                          settings.warmup_steps_excluded) if world.main else (lambda state, seconds, positions: None)
    hooks = Hooks(log=log, evaluate=run_eval if evaluate else None, save=save,
                  should_stop=lambda: stop["requested"], step_done=watch)
    before = run_eval(0) if evaluate and state.step == 0 else None
    if before:
        log({"step": 0, **before})
        say(world, f"eval before training: loss {before['eval_loss']:.4f}, perplexity {before['perplexity']:.2f}")
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    wall = time.perf_counter()
    try:
        try:
            reset_peak_memory(device)  # the summary's peak is the training loop's, not a probe's or the loading's
            with sampler:
                state = train(objective_, optimizer, scheduler, next_micro_batch, state, settings, hooks, scaler)
            if not (settings.save_steps and state.step % settings.save_steps == 0):  # the loop did not just save it
                save(state)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        wall = time.perf_counter() - wall
        peaks = distributed.gather(world, peak_memory_mb(device))
        after = run_eval(state.step) if evaluate else {}
        if after:
            log({"step": state.step, **after})
    finally:
        if metrics:
            metrics.close()
    peaks = peaks or [0.0]
    return Outcome(state, wall, before, after, sampler.summary(), max(peaks), sum(peaks))


def say(world: World, message: str) -> None:
    """Print on rank 0 only: one console, not one copy per rank."""
    if world.main:
        print(message)


def figures(outcome: Outcome, flops_per_token: float, plan: hardware.Plan, hw: hardware.Hardware,
            world: World = World()) -> dict[str, Any]:
    """The summary figures every job reports: throughput over the measured steps (warm-up excluded),
    real tokens of all ranks, MFU against the peak of all the devices the ranks use, memory, losses."""
    s = outcome.state
    measured = s.measured_time_s or s.train_time_s
    tokens_per_s = (s.measured_tokens or s.tokens) / measured if measured else None
    # One GPU per rank; on CPUs, the ranks of a machine share its cores: its peak at all their threads.
    threads = plan.threads if plan.device == "cuda" else plan.threads * world.local_size
    peak, peak_source = hardware.peak_tflops(plan.device, plan.precision, hw, threads,
                                             models.cache_dir() / "peak_flops.json")
    if peak is not None:
        peak *= world.size if plan.device == "cuda" else world.nodes
    return {
        "device": plan.device, "precision": plan.precision, "world_size": world.size,
        "steps": s.step, "samples": s.samples, "tokens": s.tokens,
        "duration_s": round(outcome.wall_s, 3), "train_time_s": round(s.train_time_s, 3),
        "samples_per_s": s.samples / s.train_time_s if s.train_time_s else None,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token, "peak_tflops": peak, "peak_tflops_source": peak_source,
        "mfu": mfu(flops_per_token, tokens_per_s, peak),
        "data_wait_fraction": round(s.data_time_s / s.train_time_s, 4) if s.train_time_s else 0.0,
        "peak_memory_mb": round(outcome.peak_memory_mb, 1),
        "peak_memory_mb_total": round(outcome.peak_memory_mb_total, 1),
        **outcome.monitor,
        "train_loss": float(np.mean(s.losses)) if s.losses else None,
        "final_train_loss": s.losses[-1] if s.losses else None,
        "eval_loss_before": outcome.before["eval_loss"] if outcome.before else None,
        "eval_loss": outcome.after.get("eval_loss"), "perplexity": outcome.after.get("perplexity"),
    }


def report(summary: dict[str, Any], out: Path) -> None:
    """The closing lines of a run."""
    if summary["eval_loss"] is not None:
        print(f"eval after training: loss {summary['eval_loss']:.4f}, perplexity {summary['perplexity']:.2f}")
    if summary["data_wait_fraction"] > 0.1:
        print(f"warning: input-bound: {100 * summary['data_wait_fraction']:.0f}% of step time went to producing "
              "batches; lower --max-length padding waste or move tokenization off the hot path (see tunebench "
              "bench-data)")
    mfu_text = f"MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None \
        else f"MFU n/a ({summary['peak_tflops_source']})"
    print(f"{summary['steps']} steps in {summary['duration_s']:.1f}s, {summary['tokens_per_s'] or 0:,.0f} real "
          f"tokens/s, {mfu_text}; saved to {out}")
