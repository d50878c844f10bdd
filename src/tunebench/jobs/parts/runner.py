"""A training run's set-up around the loop: its opening (hardware plan, process group, output directory and resume
point, batch, threads and seed), the host's settings rows, the learning rate, the records and trackers, the
objective as the process group wraps it and the slowdown watch. It reads the sections every run shares (RunBase),
so it lives with the jobs' parts, not in training/, which takes only what it reads.

Beside it, each with one job: jobs/parts/measuring.py (the measured decisions, rank 0 alone), training/feed.py (the
loop's micro batches and each step's start), training/stopping.py (signals). jobs/parts/recipe.py's run calls them
in order; the optimizer steps themselves are training.loop.optimizer_steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core import precision as precision_
from tunebench.core import runlock
from tunebench.core.batch_rule import BatchAsk
from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.machine import distributed, hardware, trackers
from tunebench.machine.distributed import World
from tunebench.settings import yamlfiles
from tunebench.settings.schema import RunBase
from tunebench.settings.tracking import names
from tunebench.training import checkpoint, runplan
from tunebench.training.autotune import memory
from tunebench.training.objective import CausalLMLoss


@dataclass(frozen=True)
class Opened:
    """A run opened: its directory, the machine and its plan, the process group, this rank's device, the
    checkpoint it resumes from (None: step 0), the effective batch it trains with and the checkpoint's batch
    split, the batch the keys asked for and the run's seed."""

    out: Path
    hw: hardware.Hardware
    hw_plan: hardware.Plan
    world: World
    device: torch.device
    resume_from: Path | None
    effective: int
    resumed: tuple[int, int] | None
    ask: BatchAsk
    seed: int
    runtime_mb: float = 0.0  # what the process held before the model (its RSS on a CPU; 0 on a GPU)

    @property
    def autocast(self) -> torch.dtype | None:
        return precision_.autocast_dtype(self.hw_plan.precision)


def open_run(cfg: RunBase, identity: dict[str, Any]) -> Opened:
    """What both training jobs do first, in this order: plan the hardware from cfg.hardware (an impossible
    request raises), join the process group torchrun set up, check the output directory and the checkpoint to
    resume from (rank 0; every rank gets its answer), settle the effective batch at this world size, set
    threads and seeds. `cfg` is either job's configuration: only the shared sections are read."""
    h, o = cfg.hardware, cfg.output
    device = "cpu" if h.force_cpu else h.device
    hw = hardware.detect()
    hw_plan = hardware.plan(device, precision_for(h.precision, device, hw), hw, h.compile, h.threads)
    world = distributed.init(hw_plan.device, cfg.distributed.backend)
    on = distributed.device_for(world, hw_plan.device)
    out = Path(o.output_dir)
    resume_from = checkpoint.open_run(world, out, o.resume, o.overwrite, identity)
    ask = cfg.batch_ask()
    effective, resumed = runplan.effective_to_run(ask, resume_from, world.size)
    apply_plan(hw_plan)
    seed_everything(cfg.schedule.seed)
    return Opened(out, hw, hw_plan, world, on, resume_from, effective, resumed, ask, cfg.schedule.seed,
                  memory.runtime_mb(on.type))


def precision_for(request: str, device: str, hw: hardware.Hardware) -> str:
    """The precision hardware.plan is asked for; `amp` (the CPU guide's use_amp: true) wants 16-bit and
    refuses a device that has none, rather than training in fp32 under a 16-bit name."""
    if request != "amp":
        return request
    plan = hardware.plan(device, "auto", hw)
    if plan.precision == "fp32" and plan.device == "cpu" and hw.cpu_bf16:
        return "bf16"  # native bf16 that measured slower than fp32 here: amp asked for 16-bit and gets it
    if plan.precision == "fp32":
        raise TunebenchError("precision amp (use_amp: true) wants 16-bit arithmetic, and this device has no fast "
                             "16-bit (a CPU without AVX512-BF16 or AMX); set precision fp32 (use_amp: false)")
    return plan.precision


def host_rows(cfg: RunBase, hw_plan: hardware.Plan) -> list[Decision]:
    """The hardware plan's rows as this run takes them (compile is decided later, by measuring), with the
    dataloader keys HF and the CPU guide use: batches are slices of tokenized data in memory."""
    h = cfg.hardware
    pin = bool(hw_plan.value("pin_memory")) and h.dataloader_pin_memory
    rows = [d if d.setting != "pin_memory" or pin == d.value
            else Decision("pin_memory", False, "hardware.dataloader_pin_memory: false")
            for d in hw_plan.decisions if d.setting != "compile"]
    if h.force_cpu:
        rows.insert(0, Decision("force_cpu", True, f"training.force_cpu: the CPU, whatever device '{h.device}' says"))
    if h.dataloader_num_workers or h.dataloader_prefetch_factor:
        rows.append(Decision("dataloader", "in-process", "batches are slices of the tokenized data in memory"
                             + (f"; dataloader_num_workers {h.dataloader_num_workers} not needed"
                                if h.dataloader_num_workers else "")
                             + (f"; dataloader_prefetch_factor {h.dataloader_prefetch_factor} not needed: nothing "
                                "to prefetch" if h.dataloader_prefetch_factor else "")))
    return rows


def learning_rate(cfg: RunBase, effective: int, steps: int) -> tuple["Optimization", Decision]:
    """The optimizer's settings from cfg.optimizer and cfg.schedule, the lr scaled to the effective batch when
    optimizer.lr_scaling asks, and its settings row."""
    o, s = cfg.optimizer, cfg.schedule
    lr, why = scaled_lr(o.lr, effective, o.lr_scaling, o.lr_reference_batch)
    warmup = s.warmup_steps or int(s.warmup_ratio * steps)
    return (Optimization(lr, o.weight_decay, s.schedule, warmup, o.max_grad_norm, (o.adam_beta1, o.adam_beta2)),
            Decision("lr", f"{lr:g}", f"{why}; {s.schedule} after {warmup} warm-up steps"))


def scaled_lr(lr: float, effective: int, rule: str, reference: int) -> tuple[float, str]:
    if rule == "none" or effective == reference:
        return lr, "not scaled (--lr-scaling none)" if rule == "none" else f"effective batch is the reference {reference}"
    factor = effective / reference if rule == "linear" else math.sqrt(effective / reference)
    return lr * factor, f"{rule} scaling: {lr:g} x {factor:.3g} for effective batch {effective} vs {reference}"


def records(opened: Opened, cfg: RunBase, plan: runplan.RunPlan, **extra: Any
            ) -> Callable[[], tuple[dict[str, Any], dict[str, Any]]]:
    """What rank 0 writes once the run starts: config.yaml (the configuration as asked: auto stays auto) and
    plan.json (what it became: the machine, the settings with their reasons, and the job's `extra`). Returns
    both as written, for the trackers' parameters."""
    import yaml


    def write() -> tuple[dict[str, Any], dict[str, Any]]:
        yamlfiles.write_config(cfg, opened.out / "config.yaml")
        plan_ = {"hardware": opened.hw.to_dict(), "decisions": plan.to_json(), **extra}
        write_json(opened.out / "plan.json", plan_)
        return yaml.safe_load((opened.out / "config.yaml").read_text(encoding="utf-8")), json.loads(
            (opened.out / "plan.json").read_text(encoding="utf-8"))

    return write


@contextlib.contextmanager
def tracking(opened: Opened, logging) -> Iterator[trackers.Tracking]:
    """The run's experiment trackers (logging.report_to) on rank 0, named by logging.project, run_name and
    group; none elsewhere. A resumed run reopens its own tracker runs. Closing it ends the run: the trackers
    get its outcome, and the run directory's lock (core.runlock, taken when the run opened) is let go."""
    if not opened.world.main or logging.report_to == "none":
        found = trackers.Tracking()
    else:
        where = trackers.Where(opened.out, logging.project or "tunebench",
                               logging.run_name or opened.out.resolve().name, logging.group,
                               Path(logging.logging_dir) if logging.logging_dir else None)
        found = trackers.Tracking(names(logging.report_to), where, resume=opened.resume_from is not None)
    try:
        with found:
            yield found
    finally:
        runlock.release(opened.out)


def steps_row(cfg: RunBase, steps: int, what: str) -> Decision:
    """The run's length and what set it: --max-steps, --max-tokens, or epochs of `what`."""
    s = cfg.schedule
    return Decision("total_steps", steps, "--max-steps" if s.max_steps else
                    f"--max-tokens {s.max_tokens:,}" if s.max_tokens else f"{s.epochs:g} epoch(s) of {what}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def every(steps: float | None, total: int) -> int | None:
    """`eval_steps` as a step count: N steps, or below 1 that share of the run's `total` steps (HF Trainer's rule)."""
    if steps is None:
        return None
    return max(1, round(steps * total)) if steps < 1 else int(steps)


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

    def __call__(self, step: int, seconds: float, positions: int) -> None:
        if self.warned or step <= self.warmup:
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
        self.log({"step": step, "warning": message})


def objective(model, autocast_dtype, device: torch.device, world: World, parallel: str,
              loss: torch.nn.Module | None = None):
    """(module the loop trains through, module evaluation runs through, whether evaluation splits the
    batches over ranks). One process: the plain CausalLMLoss (or `loss`, another objective over the
    model). DDP: wrapped for training; evaluation runs the unwrapped copy, each rank a share. FSDP:
    sharded before the optimizer is built (it replaces the parameters); its forward gathers weights,
    so every rank evaluates every batch."""
    loss = loss or CausalLMLoss(model, autocast_dtype)
    if world.backend is None:
        return loss, loss, False
    if parallel == "fsdp":
        distributed.shard_fsdp(loss, model, world, device)
        return loss, loss, False
    return distributed.wrap_ddp(loss, world, device), loss, True


@dataclass(frozen=True)
class Optimization:
    """What the optimizer and the schedule take, from whichever job's keys gave them."""

    lr: float
    weight_decay: float
    schedule: str
    warmup_steps: int
    max_grad_norm: float
    betas: tuple[float, float] = (0.9, 0.999)


def per_source(results: list[tuple[str, dict[str, float]]]) -> dict[str, float]:
    """One dataset's eval as it is; several: the overall loss over all their held-out tokens, and each
    dataset's own as eval_loss/<name>."""
    if len(results) == 1:
        return results[0][1]
    tokens = sum(r["eval_tokens"] for _, r in results)
    loss = sum(r["eval_loss"] * r["eval_tokens"] for _, r in results) / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": tokens,
            **{f"eval_loss/{name}": r["eval_loss"] for name, r in results}}


def say(world: World, message: str) -> None:
    """Print on rank 0 only: one console, not one copy per rank."""
    if world.main:
        print(message)
