"""Micro-batches: a seeded order per epoch, padded to the longest example in the batch."""

from __future__ import annotations

import numpy as np
import torch

from tunebench.core.decision import Decision
from tunebench.data.tokenize import Tokenized

IGNORE = -100

# bf16 on a CPU (oneDNN's kernels) builds its matmul kernels, and keeps their memory, for each new padded length: a
# 2-core Intel Xeon's SmolLM2 LoRA at micro 1 grew from 867 to 1,722 MB over 40 steps of lengths drawn from 40-128,
# stayed at 979 at one length and reached 1,102 with the lengths rounded up to a multiple of 16, in the same time as
# the drawn lengths (33.0 s, 40.3 at one length of 128, 32.8 rounded); fp32 held 1,264-1,333 (2026-12-03).
CPU_BF16_MULTIPLE = 16


def pad_multiple(device_type: str, precision: str) -> Decision:
    """The padded length's multiple: CPU_BF16_MULTIPLE where bf16 runs on a CPU, else 1 (the longest row)."""
    if device_type == "cpu" and precision == "bf16":
        return Decision("pad_to_multiple_of", CPU_BF16_MULTIPLE,
                        "bf16 on a CPU builds its matmul kernels, and keeps their memory, for each new padded length: "
                        f"rows padded to a multiple of {CPU_BF16_MULTIPLE} (never past max_length) make fewer of them")
    return Decision("pad_to_multiple_of", 1, "the longest row of each micro batch: no kernels are built per length here")


def padded_width(longest: int, multiple: int = 1, cap: int | None = None) -> int:
    """A micro batch's width: its longest row rounded up to `multiple`, never past `cap` nor below `longest`."""
    width = -(-longest // multiple) * multiple
    return max(longest, min(width, cap)) if cap else width


def epoch_steps(indices: np.ndarray, effective_batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                lengths: np.ndarray | None = None) -> list[list[int]]:
    """The optimizer steps of one epoch (lists of example indices, `effective_batch_size` rows each, the
    last one maybe shorter): a pure function of (seed, epoch, effective batch), so the micro batch,
    accumulation, world size and row layout (speed decisions) only split a step's rows and never change
    them. With `lengths` (the length-grouped layout), each step's rows are sorted longest first, so the
    micro-batches it is cut into pad little; which rows a step holds stays the same.
    """
    idx = np.asarray(indices)
    if shuffle:
        idx = idx[np.random.default_rng([seed, epoch]).permutation(len(idx))]
    steps = [idx[i : i + effective_batch_size].tolist() for i in range(0, len(idx), effective_batch_size)]
    if lengths is not None:
        steps = [sorted(step, key=lambda k: -lengths[k]) for step in steps]
    return steps


def balanced_steps(indices: np.ndarray, kind_of, effective_batch_size: int, seed: int,
                   epoch: int) -> list[list[int]]:
    """The optimizer steps of one epoch with the kinds interleaved (`kind_of[i]`: example i's kind): each kind's
    examples shuffled (by seed and epoch, as epoch_steps), then taken one of each kind in turn, the kinds in an
    order drawn per epoch, and cut into steps. A step of at least as many rows as there are kinds holds every kind
    while each has examples left; once a kind runs out, the rest interleave without it (an epoch still takes each
    example once). A pure function of (seed, epoch, effective batch), as epoch_steps."""
    rng = np.random.default_rng([seed, epoch])
    idx = np.asarray(indices)
    kinds = sorted({kind_of[i] for i in idx.tolist()})
    queues = [[i for i in idx[rng.permutation(len(idx))].tolist() if kind_of[i] == k] for k in kinds]
    order = rng.permutation(len(kinds)).tolist()
    mixed = [queues[k][r] for r in range(max(map(len, queues), default=0)) for k in order if r < len(queues[k])]
    return [mixed[i:i + effective_batch_size] for i in range(0, len(mixed), effective_batch_size)]


def micro_steps(step: list[int], rows_per_micro_step: int, grad_accum_steps: int) -> list[list[int]]:
    """One optimizer step's rows cut into its `grad_accum_steps` global micro-steps (micro batch x world
    size rows each, in order); a short last step of an epoch leaves the later ones empty."""
    return [step[k * rows_per_micro_step : (k + 1) * rows_per_micro_step] for k in range(grad_accum_steps)]


def epoch_order(indices: np.ndarray, micro_batch_size: int, seed: int, epoch: int, shuffle: bool = True,
                lengths: np.ndarray | None = None, effective_batch_size: int | None = None) -> list[list[int]]:
    """The micro-batches of one epoch in order: its steps (see epoch_steps; by default one micro batch
    each) cut into micro-batches, empty ones left out (the batch-layout and data benchmarks count these)."""
    effective = effective_batch_size or micro_batch_size
    accum = -(-effective // micro_batch_size)
    return [m for step in epoch_steps(indices, effective, seed, epoch, shuffle, lengths)
            for m in micro_steps(step, micro_batch_size, accum) if m]


def collate(data: Tokenized, batch: list[int], pad_id: int, multiple: int = 1,
            cap: int | None = None) -> dict[str, torch.Tensor]:
    """(B, T) input_ids, attention_mask and labels; labels are IGNORE on padding and prompt tokens."""
    return pad_examples([data.example(i) for i in batch], pad_id, multiple, cap)


def pad_examples(examples: list[tuple[np.ndarray, np.ndarray]], pad_id: int, multiple: int = 1,
                 cap: int | None = None) -> dict[str, torch.Tensor]:
    """(ids, loss mask) rows, right-padded to the longest (rounded up to `multiple`, never past `cap`): collate's
    tensors."""
    width = padded_width(max(len(ids) for ids, _ in examples), multiple, cap)
    input_ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE, dtype=np.int64)
    attention = np.zeros((len(examples), width), dtype=np.int64)
    for row, (ids, mask) in enumerate(examples):
        n = len(ids)
        input_ids[row, :n] = ids
        attention[row, :n] = 1
        labels[row, :n] = np.where(mask.astype(bool), ids, IGNORE)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "labels": torch.from_numpy(labels),
    }


def eval_batches(data: Tokenized, indices, size: int, pad_id: int,
                 collate_fn=None) -> list[dict[str, torch.Tensor]]:
    """Collated batches of `indices` sorted by length: evaluation order does not matter, padding does.
    `collate_fn(data, indices, pad_id)` (default `collate`) makes each one: pairs.collate for preference
    pairs, whose `data.lengths()` is each pair's longer row."""
    lengths = data.lengths()
    order = sorted(np.asarray(indices).tolist(), key=lambda i: lengths[i])
    return [(collate_fn or collate)(data, order[i : i + size], pad_id) for i in range(0, len(order), size)]


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: positions into `lengths`, grouped into rows of at most `capacity` tokens."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, used in enumerate(fill):
            if used + lengths[k] <= capacity:
                rows[r].append(k)
                fill[r] += lengths[k]
                break
        else:
            rows.append([k])
            fill.append(lengths[k])
    return rows


def collate_packed(data: Tokenized, batch: list[int], pad_id: int, capacity: int) -> dict[str, torch.Tensor]:
    """The examples of one micro-batch packed into as few rows as fit `capacity` tokens each.

    position_ids restart at 0 for every example, and transformers turns that into a block-diagonal
    causal mask: no example attends to another. The first token of each example is no one's
    target, and the padding tail is a segment of its own that nothing attends to.
    """
    examples = [data.example(i) for i in batch]
    rows = pack_rows([len(ids) for ids, _ in examples], max(capacity, max(len(ids) for ids, _ in examples)))
    width = max(sum(len(examples[k][0]) for k in row) for row in rows)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    real = np.zeros((len(rows), width), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for k in row:
            ids, mask = examples[k]
            n = len(ids)
            input_ids[r, at : at + n] = ids
            labels[r, at : at + n] = np.where(mask.astype(bool), ids, IGNORE)
            labels[r, at] = IGNORE
            positions[r, at : at + n] = np.arange(n)
            real[r, at : at + n] = 1
            at += n
        positions[r, at:] = np.arange(width - at)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(real),  # counts real tokens; not passed to the model
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
    }


def padding_fraction(lengths: np.ndarray, batches: list[list[int]], packed_capacity: int | None = None) -> float:
    """Share of computed positions that are padding, for these batches padded (or packed) as collate would."""
    total = real = 0
    for b in batches:
        ls = [int(lengths[i]) for i in b]
        real += sum(ls)
        if packed_capacity is None:
            total += max(ls) * len(ls)
        else:
            rows = pack_rows(ls, max(packed_capacity, max(ls)))
            total += max(sum(ls[k] for k in row) for row in rows) * len(rows)
    return 1 - real / total if total else 0.0
