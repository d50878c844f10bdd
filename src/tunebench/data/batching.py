"""Micro-batches: a seeded order per epoch, padded to the longest example in the batch."""

from __future__ import annotations

import numpy as np
import torch

from tunebench.data.tokenize import Tokenized

IGNORE = -100


def epoch_order(indices: np.ndarray, micro_batch_size: int, seed: int, epoch: int, shuffle: bool = True):
    """The micro-batches (lists of example indices) of one epoch; the same (seed, epoch) gives the same order.

    The order depends on nothing but its arguments, so a resumed run can skip to any batch.
    """
    idx = np.asarray(indices)
    if shuffle:
        idx = idx[np.random.default_rng([seed, epoch]).permutation(len(idx))]
    return [idx[i : i + micro_batch_size].tolist() for i in range(0, len(idx), micro_batch_size)]


def collate(data: Tokenized, batch: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """(B, T) input_ids, attention_mask and labels; labels are IGNORE on padding and prompt tokens."""
    examples = [data.example(i) for i in batch]
    width = max(len(ids) for ids, _ in examples)
    input_ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    labels = np.full((len(batch), width), IGNORE, dtype=np.int64)
    attention = np.zeros((len(batch), width), dtype=np.int64)
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
