"""Run records: metrics.jsonl (one line per logged step), peak memory, FLOPs per token and MFU."""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tunebench.core import startup
from tunebench.core.durable import open_no_follow, repair_tail


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a killed run keeps what it logged; each record also
    goes to `also` (the run's trackers)."""

    def __init__(self, path: Path, also: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        repair_tail(path)  # a resumed run appends after a torn last line, not onto it
        self._f = open_no_follow(path, "a")  # a link planted in a shared run directory is refused
        self._also = also

    def __call__(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._also is not None:
            self._also(record)

    def close(self) -> None:
        self._f.close()


_earlier_windows_mb = 0.0  # the CPU's peak resident set in windows closed by reset_peak_memory


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window, so a probe measures its own step, not the largest one before it.

    On Linux the kernel's peak resident set is reset through /proc/self/clear_refs; elsewhere the
    window stays the process's lifetime (a probe then reads an overestimate, never an underestimate).
    """
    global _earlier_windows_mb
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _earlier_windows_mb = max(_earlier_windows_mb, _rss_peak_mb())
    startup.release_freed()  # the command keeps freed memory (see startup): the window starts without it
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the CPU's peak resident set, since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _rss_peak_mb()


def process_peak_mb() -> float:
    """The CPU's peak resident set over the whole process, resets or not."""
    return max(_earlier_windows_mb, _rss_peak_mb())


def _rss_peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):  # the peak since the last clear_refs reset
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def training_flops_per_token(matmul_params: int, trainable_params: int, n_layers: int, attn_width: int,
                             seq_len: float, full: bool) -> float:
    """Training FLOPs per token: what actually trains, plus attention (PaLM's 12·L·H·Q·T).

    A matmul with N weights costs 2N forward and 2N for the input gradient; only trained weights
    add 2N more for their weight gradient. So full fine-tuning is 6N, while LoRA on a frozen
    base is 4N plus 6 per adapter weight.
    """
    dense = 6 * matmul_params if full else 4 * matmul_params + 6 * trainable_params
    return dense + 12 * n_layers * attn_width * seq_len


def mfu(flops_per_token: float, tokens_per_s: float | None, peak_tflops: float | None) -> float | None:
    if not tokens_per_s or not peak_tflops:
        return None
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


def quantized_linear_kinds() -> tuple[type, ...]:
    """bitsandbytes' linear layers, when it is loaded: only then can a model hold them, and importing it
    just to look costs a pretraining process ~1.5 s of start-up."""
    bnb = sys.modules.get("bitsandbytes")
    return () if bnb is None else (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def logical_numel(p: torch.Tensor) -> int:
    """Number of weights a tensor stands for: bitsandbytes stores two 4-bit values per byte."""
    return p.numel() * 2 if p.__class__.__name__ == "Params4bit" else p.numel()


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their logical size."""
    trainable = total = 0
    for p in model.parameters():
        n = logical_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def flop_dims(model) -> tuple[int, int, int]:
    """(weights in matmuls, layers, attention width) of the base model, adapters excluded.

    Matmul weights include the output head (it runs even when tied to the embedding) and count
    quantized weights at their logical size; embeddings are lookups, not matmuls.
    """
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, Conv1D, *quantized_linear_kinds())
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, kinds) and "lora_" not in name:
            total += logical_numel(m.weight)
    c = model.config
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return total, layers, heads * head_dim
