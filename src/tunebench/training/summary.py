"""What a run tells its user: the settings table at the start, the summary figures and closing lines at the end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunebench.core.decision import Decision
from tunebench.machine import hardware
from tunebench.machine.distributed import World
from tunebench.machine.metrics import mfu
from tunebench.model import models
from tunebench.settings.objectives import ObjectiveBase
from tunebench.training.loop import LoopState


@dataclass
class Outcome:
    """The training loop's outcome, as a job's summary reads it (recipe.training makes it)."""

    state: LoopState
    wall_s: float  # the training loop's wall time
    before: dict[str, float] | None  # eval before training (fresh runs only)
    after: dict[str, float]
    monitor: dict[str, float]
    peak_memory_mb: float  # of the training loop, the largest of any rank
    peak_memory_mb_total: float  # summed over ranks (on one machine: what the run costs it)
    warmup_steps: int = 2  # the first steps left out of tokens_per_s (LoopSettings.warmup_steps_excluded)
    cores_shared: float | None = None  # the share of the loop's needed core time others took (monitor.CoreShare)


def print_plan(rows: list[Decision] | tuple[Decision, ...], title: str = "settings:") -> None:
    width = max(len(r.setting) for r in rows)
    value_width = min(22, max(len(str(r.value)) for r in rows))
    print(title)
    for setting, value, reason in rows:
        print(f"  {setting:<{width}}  {value!s:<{value_width}}  {reason}")


def figures(outcome: Outcome, flops_per_token: float, plan: hardware.Plan, hw: hardware.Hardware,
            world: World = World()) -> dict[str, Any]:
    """The summary figures every job reports: throughput over the measured steps (warm-up excluded),
    real tokens of all ranks, MFU against the peak of all the devices the ranks use, memory, losses."""
    s = outcome.state
    measured = s.measured_time_s or s.train_time_s
    tokens_per_s = (s.measured_tokens or s.tokens) / measured if measured else None
    # One GPU per rank; on CPUs, the ranks of a machine share its cores: its peak at all their threads.
    threads = plan.threads if plan.device == "cuda" else plan.threads * world.local_size
    cache = models.cache_dir() / "peak_flops.json"
    peak, peak_source = hardware.peak_tflops(plan.device, plan.precision, hw, threads, cache)
    if peak is not None:
        units = world.size if plan.device == "cuda" else world.nodes  # a GPU per rank; a CPU peak per machine
        achieved = flops_per_token * tokens_per_s / 1e12 / units if tokens_per_s else None
        peak, peak_source = hardware.reached(plan.device, plan.precision, hw, threads, cache, achieved, peak,
                                             peak_source)
        peak *= units
    return {
        "device": plan.device, "precision": plan.precision, "world_size": world.size,
        "steps": s.step, "samples": s.samples, "tokens": s.tokens,
        "duration_s": round(outcome.wall_s, 3), "train_time_s": round(s.train_time_s, 3),
        # tokens_per_s's clock: the steps after the first `warmup_steps` (their kernels and memory warmed)
        "steady_time_s": round(measured, 3), "warmup_steps": outcome.warmup_steps if s.measured_time_s else 0,
        "samples_per_s": s.samples / s.train_time_s if s.train_time_s else None,
        "it_per_s": s.step / s.train_time_s if s.train_time_s else None,  # optimizer steps, as the study counts them
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


def report(summary: dict[str, Any], out: Path, objective: ObjectiveBase) -> None:
    """The closing lines of a run (its evaluation in the words of its objective's type)."""
    if summary["eval_loss"] is not None:
        print(f"eval after training: {objective.describe_eval(summary)}")
    if "generated_tokens" in summary:  # a GRPO step's batches are its sampled completions
        print(f"sampling: {summary['generated_tokens']:,} tokens in {summary['generation_s']:.1f}s "
              f"({summary['generation_tokens_per_s'] or 0:,.0f} generated tokens/s, {100 * summary['data_wait_fraction']:.0f}% "
              f"of step time; {summary['prefilled_tokens']:,} context tokens fed); the updates: "
              f"{summary['update_tokens_per_s']:,.0f} tokens/s")
        print("step time: " + ", ".join(f"{part} {s:.1f}s" for part, s in summary["sampling_split_s"].items())
              + f", update {summary['update_s']:.1f}s")
    elif summary["data_wait_fraction"] > 0.1:
        print(f"warning: input-bound: {100 * summary['data_wait_fraction']:.0f}% of step time went to producing "
              "batches; lower --max-length padding waste or move tokenization off the hot path (see tunebench "
              "bench-data)")
    mfu_text = f"MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None \
        else f"MFU n/a ({summary['peak_tflops_source']})"
    # Memory beside speed: on a laptop the peak decides what fits as much as tokens/s decides how long it takes.
    memory = f"peak {'GPU memory' if summary['device'] == 'cuda' else 'RSS'} {summary['peak_memory_mb']:,.0f} MB"
    # One clock, said: the loop's wall time, the steps' share of it, and the steps tokens/s is over.
    print(f"{summary['steps']} steps in {summary['duration_s']:.1f}s ({summary['train_time_s']:.1f}s of steps, the "
          f"rest evaluations and checkpoints), {summary['tokens_per_s'] or 0:,.0f} real tokens/s over "
          f"{summary.get('steady_time_s') or summary['train_time_s']:.1f}s of steps after the first "
          f"{summary.get('warmup_steps', 0)}, {mfu_text}, {memory}; saved to {out}")
