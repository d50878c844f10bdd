"""The batch rule, at the bottom of the package: effective batch = micro batch x accumulation x world size.
The effective batch is what the user asks (or the product of what they asked); the micro batch only splits
each step's rows. The schemas check a request with it at load, and the run's plan (runplan) applies it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tunebench.core.errors import TunebenchError


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


def asked(effective: int | None, micro: int | None, accum: int | None, default_effective: int | None) -> BatchAsk:
    """The request both jobs make of the batch keys. Given values are kept as given: three that agree run,
    three that disagree are refused (check). With no effective batch given, micro x accumulation x world size
    when accumulation is given (HF Trainer's reading of per-device batch and accumulation); otherwise the
    job's default effective batch: fine-tuning keeps its own (the study's) whatever micro batch splits it, and
    pretraining (None) reads the CPU guide's batch_size as each process's batch."""
    if effective is None and accum is None and default_effective is not None:
        effective = default_effective
    return BatchAsk(effective, micro, accum)


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
