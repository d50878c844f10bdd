"""Hand-written fast paths that transformers and torch do not offer as such.

`causal_attention` is registered with transformers as the attention implementation "tunebench"
and competes with "eager" and "sdpa" in the per-run measurement (`finetune.pick_attention`).
For the causal, unmasked case that training on right-padded rows is (see `loop.loss_sum`), it
runs grouped-query attention without copying keys and values per query head: the query heads
that share a key head are stacked into one matrix, so each product is one batched matmul, the
causal mask and the scale ride inside `baddbmm`, and the backward has no head-sum. Anything else
(a padding or block mask, a KV cache, a model with its own attention quirks) goes to transformers'
SDPA path unchanged.
"""

from __future__ import annotations

import torch

NAME = "tunebench"
_masks: dict[tuple, torch.Tensor] = {}


def _causal_bias(length: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, groups * length, length) additive causal mask for `groups` query heads stacked row-wise."""
    if torch.compiler.is_compiling():  # built inside the graph; the compiler fuses it into the add
        rows = torch.arange(groups * length, device=device) % length
        allowed = rows[:, None] >= torch.arange(length, device=device)[None, :]
        zero, blocked = (torch.full((), v, dtype=dtype, device=device) for v in (0.0, float("-inf")))
        return torch.where(allowed, zero, blocked)[None]
    key = (length, groups, dtype, device)
    bias = _masks.get(key)
    if bias is None:
        if len(_masks) > 32:
            _masks.clear()
        causal = torch.full((length, length), float("-inf"), dtype=dtype, device=device).triu_(1)
        bias = _masks[key] = causal.repeat(groups, 1)[None]
    return bias


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Same signature and result as transformers' attention functions: (B, T, H, D) output, no weights."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    plain = (attention_mask is None and getattr(module, "is_causal", True) and key.shape[2] == length
             and length > 1 and heads % kv_heads == 0 and kwargs.get("softcap") is None
             and kwargs.get("sliding_window") is None and getattr(module, "sinks", None) is None)
    if not plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch * kv_heads, groups * length, dim)  # the query heads of one key head, stacked
    k = key.reshape(batch * kv_heads, length, dim)
    v = value.reshape(batch * kv_heads, length, dim)
    scores = torch.baddbmm(_causal_bias(length, groups, q.dtype, q.device), q, k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1)  # low-precision input, fp32 arithmetic inside the kernel
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.bmm(probs, v).view(batch, heads, length, dim)
    return out.transpose(1, 2).contiguous(), None


# Bytes per T x T attention element each layer keeps for the backward, by kernel and compute
# element size: eager keeps its fp32 softmax and, in 16-bit, the cast copy; ours keeps one softmax
# in the compute dtype; sdpa's fused kernels keep none (memory linear in T). A test checks these
# against what autograd really saves.
_SAVED_BYTES = {"eager": lambda item: 4 + item if item < 4 else 4, NAME: lambda item: item}


def saved_weights_mb(config, rows: int, length: int, impl: str, itemsize: int) -> float:
    """Memory the attention weights of every layer hold between forward and backward (0 for sdpa)."""
    per_element = _SAVED_BYTES.get(impl)
    if per_element is None:
        return 0.0
    elements = config.num_hidden_layers * rows * config.num_attention_heads * length * length
    return elements * per_element(itemsize) / 2**20


def register() -> str:
    """Make "tunebench" a valid `attn_implementation` (idempotent); return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, causal_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # None for a purely causal batch, else a bool mask
    return NAME
