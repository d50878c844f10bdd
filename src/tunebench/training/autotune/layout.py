"""How rows become batches: padded, length-grouped or packed, by the padding each leaves."""

from __future__ import annotations

import numpy as np

from tunebench.data import batching

PACKING_MIN_GAIN = 0.02  # a layout other than plain padding must remove at least 2 points of padding


def decide(packing: str, lengths: np.ndarray, train_idx: np.ndarray, micro_batch_size: int, seed: int,
           capacity: int, effective_batch_size: int | None = None) -> tuple[str, str]:
    """(layout, reason). The padding share is computed over the first epoch's batches exactly as
    collate would build them; padded positions cost as much compute as real ones."""
    plain = batching.epoch_order(train_idx, micro_batch_size, seed, 0, effective_batch_size=effective_batch_size)
    waste = {
        "padded": batching.padding_fraction(lengths, plain),
        "length-grouped": batching.padding_fraction(
            lengths, batching.epoch_order(train_idx, micro_batch_size, seed, 0, lengths=lengths,
                                          effective_batch_size=effective_batch_size)),
        "packed": batching.padding_fraction(lengths, plain, capacity),
    }
    numbers = ", ".join(f"{k} {100 * v:.0f}%" for k, v in waste.items())
    if packing == "on":
        return "packed", f"asked for (padding: {numbers})"
    options = ["padded", "length-grouped"] + (["packed"] if packing == "auto" else [])
    best = min(options, key=lambda k: (round(waste[k], 2), options.index(k)))  # ties: the simpler layout
    if waste["padded"] - waste[best] < PACKING_MIN_GAIN:
        best = "padded"
    return best, f"least padding of {numbers}" if best != "padded" else f"padding: {numbers}"
