"""The run's plan: the batch arithmetic and every decision, made once and frozen.

Both training jobs, resume and `tunebench hw` take their batch rules from here and nowhere else:
effective batch = micro batch x accumulation x world size; the effective batch is what the user
asks (or the product they asked); the micro batch is a speed decision (measured with `auto`) that
only splits each step's rows, never changes them (see data.batching.epoch_steps).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.errors import TunebenchError
from tunebench.hardware import Decision


@dataclass(frozen=True)
class BatchAsk:
    """What the user asked of the batch, in the job's own flag names (for the messages)."""

    effective: int | None  # rows per optimizer step over all ranks; None: micro x accum x world
    micro: int | None  # None: auto (measured)
    accum: int | None  # None: derived from the effective batch
    flags: tuple[str, str, str] = ("--effective-batch-size", "--batch-size", "--grad-accum")

    def effective_for(self, world_size: int) -> int:
        """The effective batch at this world size, once check() passed."""
        if self.effective is not None:
            return self.effective
        return (self.micro or 1) * (self.accum or 1) * world_size

    def check(self, world_size: int = 1) -> int:
        """The effective batch, or a refusal naming the flags the user set and the fix."""
        eff_flag, micro_flag, accum_flag = self.flags
        if self.micro is None and self.accum is not None:
            raise TunebenchError(f"{micro_flag} auto derives {accum_flag} from {eff_flag}; drop {accum_flag}")
        if self.micro is not None and self.accum is not None and self.effective is not None \
                and self.micro * self.accum * world_size != self.effective:
            raise TunebenchError(f"{micro_flag} {self.micro} x {accum_flag} {self.accum}"
                                 + (f" x {world_size} ranks" if world_size > 1 else "")
                                 + f" != {eff_flag} {self.effective}; set only two of the three")
        effective = self.effective_for(world_size)
        ranks = f"{world_size} rank(s)" if world_size > 1 else ""
        if effective % world_size or (self.micro is not None and (effective // world_size) % self.micro):
            by = " x ".join(filter(None, (ranks, f"{micro_flag} {self.micro}" if self.micro is not None else "")))
            raise TunebenchError(f"{eff_flag} {effective} is not a multiple of {by}; pick "
                                 + (f"a micro batch that divides it, leave {micro_flag} on auto, or set {accum_flag}"
                                    if world_size == 1 else "an effective batch that they divide, or another "
                                                            "number of processes"))
        return effective


def launched_world_size() -> int:
    """The world size torchrun gave this process (its WORLD_SIZE), 1 outside torchrun: a configuration is
    checked at load against the world it will train in (1 x 1 x 2 ranks is an effective batch of 2)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def micro_candidates(effective: int, world_size: int, rows: int) -> list[int]:
    """Micro batches `auto` measures: those dividing one rank's share of the effective batch (so
    accumulation keeps it exact), no larger than the rows there are."""
    share = effective // world_size
    return [m for m in range(1, share + 1) if share % m == 0 and m <= max(rows, 1)] or [1]


def accumulation(effective: int, micro: int, world_size: int) -> int:
    return effective // (micro * world_size)


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


def resumed_batch(resume: Path | None, world_size: int, micro_asked: int | None,
                  accum_asked: int | None) -> tuple[int, int] | None:
    """(micro batch per rank, accumulation) that continue checkpoint `resume` under this world size: its
    rows per micro-step shared out over the ranks, so every optimizer step sees the same rows it would
    have. None when not resuming. A micro batch or accumulation asked for (None: auto) that differs
    is refused, not replaced."""
    if resume is None:
        return None
    from tunebench import checkpoint

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
        return next(d.value for d in self.decisions if d.setting == setting)

    def to_json(self) -> list[dict[str, Any]]:
        return [d._asdict() for d in self.decisions]


@dataclass(frozen=True)
class Measured:
    """What the measurements decided (rank 0 measures; the other ranks receive this)."""

    decisions: tuple[Decision, ...]  # attention, gradient checkpointing, micro batch, compile
    micro_batch_size: int
    grad_accum_steps: int
    tokens_per_s: float | None

    @property
    def compiled(self) -> bool:
        return any(d.setting == "compile" and d.value is True for d in self.decisions)

    @property
    def attention(self) -> str:
        return str(next((d.value for d in self.decisions if d.setting == "attention"), "sdpa"))


def measure_batch(effective: int, world_size: int, resumed: tuple[int, int] | None, micro_asked: int | None,
                  probe: Callable[[], tuple[int, list[Decision], float]], asked_reason: str,
                  known_speed: Callable[[int], float | None] = lambda micro: None) -> \
        tuple[int, list[Decision], float | None]:
    """(micro batch, its rows, probed tokens/s): the checkpoint's, the one asked for, or `probe()`'s.
    For a size asked for, the tokens/s is `known_speed`'s: what an earlier probe measured, if any."""
    if resumed:
        return resumed[0], [Decision("micro_batch_size", resumed[0], f"the checkpoint's rows per micro-step over "
                                                                     f"{world_size} rank(s)")], None
    if micro_asked is None:
        micro, rows, speed = probe()
        return micro, [Decision(*r) for r in rows], speed
    return micro_asked, [Decision("micro_batch_size", micro_asked, asked_reason)], known_speed(micro_asked)


def batch_row(effective: int, micro: int, accum: int, world_size: int, unit: str = "") -> Decision:
    return Decision("grad_accum_steps", accum, f"effective batch {effective} = {micro} x {accum}"
                    + (f" x {world_size} ranks" if world_size > 1 else "") + unit)


def measure(model, step, shape, *, world_size: int, device, precision: str, attention_asked: str,
            attention_rows: int, widest: int, effective: int, resumed: tuple[int, int] | None,
            micro_asked: int | None, asked_reason: str, n_train: int, max_length: int, checkpointing: str,
            compile_asked: Decision, quantized: bool, run_tokens: float, local_ranks: int = 1,
            compile_mode: str = "default") -> Measured:
    """The measured decisions both jobs share, in order: attention kernel, micro batch (the effective
    batch stays fixed), gradient checkpointing, compile. `step` is a tune.probe step function;
    `run_tokens` the tokens the whole run will compute (compile pays off over those)."""
    from tunebench.tune import attention, batch, compiler

    rows: list[Decision] = []
    if checkpointing == "on":
        rows.append(Decision("gradient_checkpointing", True, "asked for"))
    rows.append(attention.decide(model, attention_asked, lambda: step(attention_rows)[0], shape, attention_rows,
                                 widest, precision, device))
    micro, batch_rows, speed = measure_batch(
        effective, world_size, resumed, micro_asked,
        lambda: batch.micro_batch(step, shape, effective // world_size, n_train, max_length, device, local_ranks),
        asked_reason, lambda micro: batch.cached_speed(shape, effective // world_size, n_train, micro, local_ranks))
    rows += batch_rows
    if checkpointing == "auto" and not any(r.setting == "gradient_checkpointing" for r in rows):
        rows.append(Decision("gradient_checkpointing", False, "the batch fits without recomputation"))
    accum = resumed[1] if resumed else accumulation(effective, micro, world_size)
    rows.append(compiler.pick(model, compile_asked, quantized, lambda: step(micro)[0], run_tokens, shape, micro,
                              speed, compile_mode))
    return Measured(tuple(rows), micro, accum, speed)


def make(hw_plan, world, parallel: Decision, measured: Measured, effective: int, accum: int, steps: int,
         rows: list[Decision]) -> RunPlan:
    """The frozen plan of a run from its parts; `rows` is the settings table in print order."""
    return RunPlan(hw_plan.device, hw_plan.precision, hw_plan.threads, world.size, str(parallel.value),
                   measured.attention, measured.micro_batch_size, accum, effective, steps, measured.compiled,
                   measured.tokens_per_s, tuple(Decision(*r) for r in rows))


def logging_row(asked: int | None, device_type: str) -> Decision:
    if asked:
        return Decision("logging_steps", asked, "asked for")
    if device_type in ("cuda", "mps"):
        return Decision("logging_steps", 10, "every 10 steps: reading a loss makes the host wait for the GPU, so the "
                                             "loop keeps them on the device in between")
    return Decision("logging_steps", 1, "every step: on a CPU, reading the loss costs nothing")
