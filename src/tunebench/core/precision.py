"""A run's precision as torch sees it: the dtype of each name, and the autocast a model computes under.
A leaf: training (loop.py) and inference (inference.py) both take it from here, so a model is always run
the way it was trained."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a run's precision -> dtype


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype matmuls run in under a run's precision; None for fp32 (no autocast)."""
    return None if precision == "fp32" else DTYPES[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
