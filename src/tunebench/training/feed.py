"""What the loop is fed: each optimizer step's units cut into this rank's micro batches (Batches, made by a
job for the micro batch decided), each step announced before its first micro batch (GRPO's rollout), and the filler
a rank gets when a short step leaves it no rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tunebench.core.decision import Decision
from tunebench.data import batching
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.training.loop import LoopState
from tunebench.training.objective import Batch


@dataclass(frozen=True)
class Batches:
    """How a run's micro batches are made, once its micro batch is decided (a Recipe's `batches`)."""

    steps: Callable[[int], list[list[int]]]  # epoch -> its optimizer steps, each a list of unit indices
    collate: Callable[[list[int], list[int]], Batch]  # (this rank's units of a micro-step, the global micro-step's)
    rows: list[Decision] = field(default_factory=list)  # settings rows such as the batch layout's
    # (epoch, step in the epoch, this rank's units of it): run before the step's first micro batch is collated;
    # GRPO's rollout (its groups sampled, scored and given their advantages, which collate then cuts into rows)
    begin_step: Callable[[int, int, list[int]], None] | None = None


def micro_batches(steps: Callable[[int], list[list[int]]], collate: Callable[[list[int], list[int]], Batch],
                  world: World, micro_batch_size: int, grad_accum_steps: int,
                  begin_step: Callable[[int, int, list[int]], None] | None = None) -> Callable[[LoopState], Batch]:
    """The loop's `next_micro_batch`. `steps(epoch)` lists the epoch's optimizer steps (a pure function
    of seed, epoch and effective batch: batching.epoch_steps); each is cut into `grad_accum_steps`
    global micro-steps of micro batch x world size rows; `begin_step`, if given, is told each step (its epoch,
    its index, this rank's units of it: step_share) before its first micro-step, and this rank collates its share:
    `collate(its rows, the global micro-step's rows)` (KTO pairs each completion with another of the global
    micro-step, so ranks together hold what one process would). The data position (epoch, batch_in_epoch)
    counts global micro-steps. A short last step can leave a rank no rows: it gets a filler row with no
    loss and no real tokens (or, for an objective that counts its own units, a real row with `counts` 0 and
    `live` 0, by which the loop multiplies its loss and figures), because every rank must run the same number of
    forward/backward passes for the gradient sync (one process skips it)."""
    epochs: dict[int, list[list[int]]] = {}

    def next_micro_batch(s: LoopState) -> Batch:
        order = epochs.get(s.epoch)
        if order is None:  # once an epoch: the shuffle and its lists are O(rows), not O(1) a micro-batch
            order = epochs[s.epoch] = steps(s.epoch)
        if s.batch_in_epoch >= len(order) * grad_accum_steps:
            epochs.pop(s.epoch, None)
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
            return next_micro_batch(s)
        k, j = divmod(s.batch_in_epoch, grad_accum_steps)
        if j == 0 and begin_step is not None:  # checkpoints fall between steps: a resume starts at a j of 0 too
            begin_step(s.epoch, k, step_share(order[k], world, micro_batch_size, grad_accum_steps))
        rows = batching.micro_steps(order[k], micro_batch_size * world.size, grad_accum_steps)[j]
        s.batch_in_epoch += 1
        mine = distributed.shard(rows, world, micro_batch_size)
        if mine:
            return collate(mine, rows)
        filler = collate(order[k][:1], order[k][:1])
        if "counts" in filler:  # an objective that counts its own units: they and its loss are multiplied by 0
            return {**filler, "counts": torch.zeros_like(filler["counts"]), "live": torch.zeros(())}
        return {**filler, "labels": torch.full_like(filler["labels"], -100),
                "attention_mask": torch.zeros_like(filler["attention_mask"])}

    return next_micro_batch


def step_share(step: list[int], world: World, micro_batch_size: int, grad_accum_steps: int) -> list[int]:
    """This rank's rows of one optimizer step: its shares of the step's global micro-steps, in order (what
    micro_batches hands it over the step)."""
    return [row for rows in batching.micro_steps(step, micro_batch_size * world.size, grad_accum_steps)
            for row in distributed.shard(rows, world, micro_batch_size)]
