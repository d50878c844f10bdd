"""Batched decoding with the KV cache, written for throughput on a CPU: what everything that generates runs on
(GRPO's sampling, eval --generate, generate and chat, serve and its OpenAI API, pretraining's samples).

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
PEFT's prompt-learning adapters (prefix, prompt, p-tuning) are the exception: they put their virtual tokens in
through generate's own input preparation, so they keep `generate`, behind the same call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache

from tunebench.model import methods


def sample_from(logits: torch.Tensor, temperature: float | None, top_p: float, top_k: int = 0) -> torch.Tensor:
    """(B, 1) next tokens: greedy when temperature is None, else drawn from softmax(logits / temperature) kept to
    the top_k likeliest tokens (0: all) and to the smallest set of them whose probability reaches top_p, by
    inverse CDF with the global generator."""
    if temperature is None:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float("-inf"))
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the tokens before the mass reaches top_p, and it
        keep[:, 0] = True  # the likeliest always (top_p 0 would keep nothing, and token 0 would come out forever)
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


def cache_keyword(model) -> str:
    """The name transformers' forward takes the KV cache by: `cache` from 5.24 (`past_key_values` deprecated
    there, to go in 5.40), `past_key_values` before; the output carries it under the same name."""
    return "cache" if "cache" in inspect.signature(methods.base_of(model).forward).parameters else "past_key_values"


Each = Callable[[torch.Tensor], bool]  # called with each step's (B,) new tokens; True stops the decoding


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: int | None, pad: int,
           temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, each: Each | None = None
           ) -> torch.Tensor:
    """(B, new) tokens after the left-padded prompts `ids` (attention `mask`), padding after each row's EOS
    (eos None: every row runs max_new_tokens). `each` sees the tokens as they come (a streamed reply) and may
    stop the decoding. The caller holds the model in eval mode under its autocast (inference.Placed.running)."""
    if max_new_tokens <= 0:
        return ids.new_zeros((ids.shape[0], 0))
    if methods.is_prompt_learning(model):
        return _by_generate(model, ids, mask, max_new_tokens, eos, pad, temperature, top_p, top_k, each)
    device = ids.device
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    out = []
    with eager_attention(model, device):
        kw = cache_keyword(model)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{kw: DynamicCache()},
                     use_cache=True, logits_to_keep=1)
        last = positions[:, -1:]
        for _ in range(max_new_tokens):
            token = sample_from(step.logits[:, -1], temperature, top_p, top_k)
            token = torch.where(done[:, None], torch.full_like(token, pad), token)
            out.append(token)
            if eos is not None:
                done |= token[:, 0] == eos
            if (each is not None and each(token[:, 0])) or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            last = last + 1
            step = model(input_ids=token, attention_mask=mask, position_ids=last, **{kw: getattr(step, kw)},
                         use_cache=True, logits_to_keep=1)
    return torch.cat(out, 1) if out else ids.new_zeros((ids.shape[0], 0))


def _by_generate(model, ids, mask, max_new_tokens, eos, pad, temperature, top_p, top_k, each) -> torch.Tensor:
    """decode's result through transformers' generate, for the adapters that need its input preparation."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Streamer(BaseStreamer):  # generate puts the prompt first, then each step's tokens
        prompt_seen, stop = False, False

        def put(self, value):
            if self.prompt_seen and each is not None:
                self.stop = bool(each(value.reshape(-1)))
            self.prompt_seen = True

        def end(self):
            pass

    class Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), streamer.stop, dtype=torch.bool, device=input_ids.device)

    streamer, sampling = Streamer(), temperature is not None
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sampling,
                         temperature=temperature, top_p=top_p if sampling else None, top_k=top_k or None,
                         pad_token_id=pad, eos_token_id=eos, streamer=streamer,
                         stopping_criteria=StoppingCriteriaList([Stop()]))
    return out[:, ids.shape[1]:]
