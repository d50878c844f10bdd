"""The measured decisions of a run (attention kernel, micro batch with the effective batch fixed, gradient
checkpointing, compile): what a job's units describe, measured once by rank 0 (the other ranks take its answers),
with the compile row the machine's plan gives."""

from __future__ import annotations

import time
from collections.abc import Callable

from tunebench.core.decision import Decision
from tunebench.jobs.parts.runner import Opened
from tunebench.machine import distributed, hardware
from tunebench.machine.distributed import World
from tunebench.settings.schema import RunBase, budget_seconds
from tunebench.training import autotune, runplan
from tunebench.training.autotune import known


def decide(opened: Opened, cfg: RunBase, model, step, units: runplan.Units, run_tokens: float,
            parallel: Decision, planned_peak: Callable[[str, int], float] | None = None) -> tuple[runplan.Measured, float]:
    """The measured decisions (attention kernel, micro batch with the effective batch fixed, gradient
    checkpointing, compile) for what `units` describe on this machine, and the seconds they took. `step` is an
    autotune.probe step; a micro batch the job's math fixes (`units.micro`) is taken like one the user asked for;
    `planned_peak` (kernel, units) -> MB is the memory plan of a probe step (runplan.Workload)."""
    hw, hw_plan, world, h, u = opened.hw, opened.hw_plan, opened.world, cfg.hardware, units

    def measure_() -> runplan.Measured:
        shape = u.what.shape(max_length=u.max_length, where=autotune.where(hw, hw_plan, opened.device),
                             precision=hw_plan.precision, torch=hw.versions.get("torch", ""), attention=h.attention,
                             liger=h.liger, gradient_checkpointing=h.gradient_checkpointing)
        return runplan.measure(model, step, runplan.Workload(
            shape=shape, world_size=world.size, local_ranks=world.local_size, device=opened.device,
            precision=hw_plan.precision, attention_asked=h.attention,
            # the kernels' timing units: ATTENTION_ROWS rows (a GRPO group of 8 is 8 rows), or the micro batch asked
            attention_rows=min(opened.ask.micro or max(1, runplan.ATTENTION_ROWS // u.rows_each), u.n),
            widest=u.widest, max_length=u.max_length, n_train=u.n, effective=opened.effective,
            resumed=opened.resumed, micro_asked=u.micro or opened.ask.micro, asked_reason=u.asked_reason,
            checkpointing=h.gradient_checkpointing, compile_asked=compile_decision(hw_plan, parallel.value),
            compile_mode=h.compile_mode, quantized=u.quantized, run_tokens=run_tokens, measure_mode=h.measure,
            time_cap_s=budget_seconds(cfg.schedule.time_budget) if cfg.schedule.time_budget else None,
            known=known.for_run(hw, hw_plan.precision, opened.device.type, hw_plan.threads, model, u.max_length,
                                shape.method), planned_peak=planned_peak))

    return measured_by_rank0(world, model, measure_)


def measured_by_rank0(world: World, model, measure: Callable[[], runplan.Measured]) -> tuple[runplan.Measured, float]:
    """The measured decisions and the seconds they took (reported apart from training): rank 0 measures, the
    other ranks take its answers and apply them to their copy of the model (ranks never disagree, never race
    on the cache)."""
    started = time.perf_counter()
    measured = distributed.agree(world, measure, safe=(runplan.Measured, Decision, autotune.Key))
    seconds = time.perf_counter() - started
    if not world.main:
        runplan.apply_measured(model, list(measured.decisions))
    return measured, seconds


def compile_decision(plan: hardware.Plan, parallel: str) -> Decision:
    """What compiler.pick is asked: the plan's, except under FSDP sharding, where it is off."""
    if parallel == "fsdp":
        return Decision("compile", False, "not combined with FSDP sharding here")
    return plan.decision("compile")
