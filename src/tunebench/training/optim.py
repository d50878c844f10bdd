"""The optimizer and learning-rate schedule every training job uses."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from tunebench.core.decision import Decision

WSD_DECAY_FRACTION = 0.2  # warmup-stable-decay: the last fifth of the steps decays (MiniCPM's recipe uses 10-20%)


def fused_adamw(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu")


def optimizer_row(device: torch.device, weight_decay: float) -> tuple[str, Any, str]:
    decay = f"; weight decay {weight_decay:g} on matrices only (not norms, biases)" if weight_decay else ""
    if fused_adamw(device):
        return Decision("optimizer", "AdamW, fused", "one kernel for all parameters; on a CPU 5x faster than foreach "
                                             "(80 vs 407 ms a step for 135M fp32 weights)" + decay)
    return Decision("optimizer", "AdamW, foreach", f"tunebench uses torch's fused AdamW on CUDA and CPU, not {device.type}"
            + decay)


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split as is standard: weight decay on >= 2-D weights (matmuls, embeddings)
    only; norms' gains and biases are not pulled towards zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return groups


def adamw(model, lr: float, weight_decay: float, device: torch.device,
          betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel: the optimizer step of full fine-tuning on a CPU runs
    about 5x faster than the default foreach path (80 vs 407 ms for SmolLM2's 135M fp32 weights)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused_adamw(device) or None)


def scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int):
    """transformers' schedules: linear warm-up, then cosine, linear or constant, or warmup-stable-decay
    (constant after warm-up, cosine down over the last WSD_DECAY_FRACTION of the steps)."""
    decay = 0
    if name == "warmup_stable_decay":
        decay = min(max(1, math.ceil(WSD_DECAY_FRACTION * total_steps)), max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, name=name, warmup=warmup_steps,
                                                                total=total_steps, decay=decay))


# transformers.get_scheduler's formulas, written out: the module that holds them imports the Trainer's
# utilities, and with them peft and bitsandbytes, ~1.8 s of start-up in every pretraining process for four
# formulas. A test holds them to get_scheduler's values, float for float.
def lr_factor(step: int, *, name: str, warmup: int, total: int, decay: int) -> float:
    """The learning rate's multiplier at `step`; `decay` is warmup-stable-decay's number of decay steps."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    if name == "cosine":
        return _half_cosine(float(step - warmup) / float(max(1, total - warmup)))
    stable = total - warmup - decay  # warmup_stable_decay
    if step < warmup + stable:
        return 1.0
    if step < total:
        return _half_cosine(float(step - warmup - stable) / float(max(1, decay)))
    return 0.0


def _half_cosine(progress: float) -> float:
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
