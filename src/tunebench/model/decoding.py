"""Batched decoding with the KV cache, written for throughput on a CPU: what GRPO's sampling runs on.

Written here rather than calling transformers' `generate`, which measured 300 tokens/s for SmolLM2-135M at batch
32 on a 2-core AVX512-BF16 VM where this loop makes 580 (benchmarks/generation.py), from two things `generate`
does not let a caller change:
- sampling: `generate` draws with torch.multinomial, whose exponential_ over the (batch, vocabulary) probabilities
  took 23 ms of a 108 ms step; here one uniform draw per row is looked up in the cumulative probabilities
  (inverse-CDF sampling: the same distribution, one searchsorted per row);
- attention: at one query position PyTorch's CPU flash-attention kernel took a third of the step; eager
  attention (two small matmuls) is faster there, so decoding on a CPU runs the model's eager attention (the
  prompt's prefill too: one call). On CUDA the model keeps its own kernel.
The model still does the forward passes (its own cache class, positions and masks), so any transformers causal
LM decodes here; rows are left-padded, and a row that reached EOS is fed padding until every row has.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache


def sample_from(logits: torch.Tensor, temperature: float | None, top_p: float) -> torch.Tensor:
    """(B, 1) next tokens: greedy when temperature is None, else drawn from softmax(logits / temperature) kept to
    the smallest set of tokens whose probability reaches top_p, by inverse CDF with the global generator."""
    if temperature is None:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the tokens before the mass reaches top_p, and it
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp(max=probs.shape[-1] - 1)


@contextlib.contextmanager
def eager_attention(model, device: torch.device):
    """The model's eager attention while decoding on a CPU (see the module docstring); put back after."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    kept = [c._attn_implementation for c in configs]
    if device.type == "cpu":
        for c in configs:
            c._attn_implementation = "eager"
    try:
        yield
    finally:
        for c, k in zip(configs, kept):
            c._attn_implementation = k


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: int, pad: int,
           temperature: float | None = None, top_p: float = 1.0) -> torch.Tensor:
    """(B, new) tokens after the left-padded prompts `ids` (attention `mask`), padding after each row's EOS. The
    caller holds the model in eval mode under its autocast (inference.Placed.running)."""
    device = ids.device
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    out = []
    with eager_attention(model, device):
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=DynamicCache(),
                     use_cache=True, logits_to_keep=1)
        last = positions[:, -1:]
        for _ in range(max_new_tokens):
            token = sample_from(step.logits[:, -1], temperature, top_p)
            token = torch.where(done[:, None], torch.full_like(token, pad), token)
            out.append(token)
            done |= token[:, 0] == eos
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            last = last + 1
            step = model(input_ids=token, attention_mask=mask, position_ids=last, past_key_values=step.past_key_values,
                         use_cache=True, logits_to_keep=1)
    return torch.cat(out, 1) if out else ids.new_zeros((ids.shape[0], 0))
