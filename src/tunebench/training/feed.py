"""What the loop is fed, a whole optimizer step at a time (Steps): this rank's micro batches of the step at a data
position. RowSteps cuts a run's units into them (every objective's rows); a run whose steps sample from the weights
as they train (GRPO, RFT: training/grpo/steps.py) draws the step's groups first and has RowSteps cut those. A rank
a short step leaves no rows gets a filler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tunebench.core.decision import Decision
from tunebench.data import batching
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.training.loop import LoopState
from tunebench.training.objective import Batch


class Steps(Protocol):
    """A run's optimizer steps as the loop takes them. `next(at)` is this rank's micro batches of the step at the
    data position `at` (grad_accum_steps of them), `at` moved past them. `sampled`: its steps sample from the live
    weights, so none is made ahead of the step before it (the loop's prefetch), and a step's time is its sampling's
    too (the plan times no such step: jobs/parts/recipe.py)."""

    sampled: bool

    def next(self, at: LoopState) -> list[Batch]: ...


@dataclass(frozen=True)
class Batches:
    """How a run's steps are made, once its micro batch is decided (a Recipe's `batches`): the epoch's steps, how
    this rank's rows of a micro-step are collated, the settings rows the layout adds, and, for a run whose steps
    sample (GRPO, RFT), the step source that draws each step before RowSteps cuts it."""

    steps: Callable[[int], list[list[int]]]  # epoch -> its optimizer steps, each a list of unit indices
    collate: Callable[..., Batch]  # (this rank's units of a micro-step, the global micro-step's[, what was drawn])
    rows: list[Decision] = field(default_factory=list)  # settings rows such as the batch layout's
    sampler: Callable[[RowSteps], Steps] | None = None  # RowSteps -> the sampling step source over them

    @property
    def sampled(self) -> bool:
        return self.sampler is not None

    def feed(self, world: World, micro_batch_size: int, grad_accum_steps: int,
             collate: Callable[..., Batch] | None = None) -> Steps:
        """The loop's Steps for this rank (`collate` in place of this one's: the recipe's, which notes the widest)."""
        rows = RowSteps(self.steps, collate or self.collate, world, micro_batch_size, grad_accum_steps)
        return self.sampler(rows) if self.sampler else rows


class RowSteps:
    """A run's steps cut into this rank's micro batches. `steps(epoch)` lists the epoch's optimizer steps (a pure
    function of seed, epoch and effective batch: batching.epoch_steps); each is cut into `grad_accum_steps` global
    micro-steps of micro batch x world size rows, and this rank collates its share: `collate(its rows, the global
    micro-step's rows, *what the step drew)` (KTO pairs each completion with another of the global micro-step, so
    ranks together hold what one process would). The data position (epoch, batch_in_epoch) counts global
    micro-steps; checkpoints fall between steps. A short last step can leave a rank no rows: it gets a filler row
    with no loss and no real tokens (or, for an objective that counts its own units, a real row with `counts` 0
    and `live` 0, by which the loop multiplies its loss and figures), because every rank must run the same number
    of forward/backward passes for the gradient sync (one process skips it)."""

    sampled = False

    def __init__(self, steps: Callable[[int], list[list[int]]], collate: Callable[..., Batch], world: World,
                 micro_batch_size: int, grad_accum_steps: int):
        self.steps, self.collate, self.world = steps, collate, world
        self.micro, self.accum = micro_batch_size, grad_accum_steps
        self.epochs: dict[int, list[list[int]]] = {}

    def at_step(self, at: LoopState) -> tuple[int, list[int]]:
        """(its index in the epoch, its units) of the step at `at`; `at` moved to the next epoch's start first where
        its epoch is done."""
        order = self.epochs.get(at.epoch)
        if order is None:  # once an epoch: the shuffle and its lists are O(rows), not O(1) a step
            order = self.epochs[at.epoch] = self.steps(at.epoch)
        if at.batch_in_epoch >= len(order) * self.accum:
            self.epochs.pop(at.epoch, None)
            at.epoch, at.batch_in_epoch = at.epoch + 1, 0
            return self.at_step(at)
        k = at.batch_in_epoch // self.accum
        return k, order[k]

    def share(self, units: list[int]) -> list[int]:
        """This rank's units of a step: its shares of the step's global micro-steps, in order (what `next` collates
        over the step)."""
        return [row for rows in batching.micro_steps(units, self.micro * self.world.size, self.accum)
                for row in distributed.shard(rows, self.world, self.micro)]

    def next(self, at: LoopState, *drawn: Any) -> list[Batch]:
        _, units = self.at_step(at)
        batches = []
        for rows in batching.micro_steps(units, self.micro * self.world.size, self.accum):
            mine = distributed.shard(rows, self.world, self.micro)
            batches.append(self.collate(mine, rows, *drawn) if mine else self._filler(units[:1], drawn))
        at.batch_in_epoch += self.accum
        return batches

    def _filler(self, first: list[int], drawn: tuple) -> Batch:
        filler = self.collate(first, first, *drawn)
        if "counts" in filler:  # an objective that counts its own units: they and its loss are multiplied by 0
            return {**filler, "counts": torch.zeros_like(filler["counts"]), "live": torch.zeros(())}
        return {**filler, "labels": torch.full_like(filler["labels"], -100),
                "attention_mask": torch.zeros_like(filler["attention_mask"])}

