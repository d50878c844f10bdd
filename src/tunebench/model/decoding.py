"""Batched decoding with the KV cache, written for throughput on a CPU: what everything that generates runs on
(GRPO's sampling, eval --generate, generate and chat, serve and its OpenAI API, pretraining's samples).

Written here rather than calling transformers' `generate`, which measured 300 tokens/s for SmolLM2-135M at batch
32 on a 2-core AVX512-BF16 VM where this loop makes 580 (benchmarks/generation.py), from two things `generate`
does not let a caller change:
- sampling: `generate` draws with torch.multinomial, whose exponential_ over the (batch, vocabulary) probabilities
  took 23 ms of a 108 ms step; here one uniform draw per row is looked up in the cumulative probabilities
  (inverse-CDF sampling: the same distribution, one searchsorted per row);
- attention: at one query position PyTorch's CPU flash-attention kernel took a third of the step; eager
  attention (two small matmuls) is faster there, so decoding on a CPU runs eager attention (the prompt's prefill
  too: one call), for grouped-query models our `grouped_attention`, which reads each cached key once instead of
  copying the cache per query head. On CUDA the model keeps its own kernel.
The model still does the forward passes (its own cache class, positions and masks), so any transformers causal
LM decodes here; rows are left-padded, and a row that reached EOS leaves the batch (its cache rows selected away,
transformers' batch_select_indices), so the rows still decoding no longer carry it; the static cache keeps its rows
(a graph replays fixed shapes) and feeds a finished row padding. Each step draws one uniform for every row, finished
or not, so a row's draws, and so its tokens, do not depend on when the others end.
PEFT's prompt-learning adapters (prefix, prompt, p-tuning) are the exception: they put their virtual tokens in
through generate's own input preparation, so they keep `generate`, behind the same call.

On a GPU a one-token step is bound by kernel launches, not arithmetic (gpt2-124m at batch 1: 132 tokens/s here
against generate's 165 on an H100, 2026-11-26). There the loop decodes into transformers' StaticCache (its buffers
sized once, its write position a tensor the cache advances itself) and replays the one-token step as a CUDA graph
(PyTorch's torch.cuda.graph): one launch a token. The step's inputs (token, position, a 4D attention mask) are
buffers updated in place, which is what graph replay needs; the prompt's prefill runs as before. What `cache`
chooses is in `decode`'s docstring; where capture fails, the loop says why once and decodes as it did.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from tunebench.model import methods

log = logging.getLogger(__name__)
GRAPH_MIN_TOKENS = 16  # shorter decodes stay eager: a capture costs about one eager step per layer's kernels
# Seconds this process spent on prefills (each decode's or turn's first forward, up to its first logits), summed:
# a caller reads its change around a decode to split prefill from decode (GRPO's step time).
PREFILL_S = [0.0]
# Where a caller asked for them (`entropies`), each sampled decode's per-row entropies: read where the logits
# already are, so watching a policy's entropy (GRPO's collapse watch) costs no forward pass of its own.
_ENTROPIES: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []


@contextlib.contextmanager
def entropies():
    """Within it, every sampled decode (a temperature given; greedy ones record nothing) appends, each a (rows,)
    tensor for its rows in order: the entropy of softmax(logits / temperature) over the whole vocabulary (before
    top_p and top_k, as TRL's `entropy`), in nats, summed over each row's sampled tokens; the tokens counted (up to
    and including its EOS); the first token's entropy."""
    recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    _ENTROPIES.append(recorded)
    try:
        yield recorded
    finally:
        _ENTROPIES.pop()


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B,) the entropy in nats of softmax(logits / temperature) over the last dimension."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def sample_from(logits: torch.Tensor, temperature: float | None, top_p: float, top_k: int = 0,
                rows: torch.Tensor | None = None, batch: int | None = None) -> torch.Tensor:
    """(B, 1) next tokens: greedy when temperature is None, else drawn from softmax(logits / temperature) kept to
    the top_k likeliest tokens (0: all) and to the smallest set of them whose probability reaches top_p, by
    inverse CDF with the global generator. `logits` may be `rows` of a batch of `batch`: the draws are made for the
    whole batch and these rows' taken, as if every row were there."""
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
    u = torch.rand(probs.shape[0] if batch is None else batch, 1, device=probs.device)
    u = (u if rows is None else u[rows]) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp(max=probs.shape[-1] - 1)


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Eager attention for grouped-query models (SmolLM2, Llama, Qwen, Gemma 3) without repeating the keys and values
    per query head: the query heads that share a key/value head are stacked as that head's rows (query head i reads
    key head i // groups, as transformers' repeat_kv lays them), so one matmul reads each cached key once. At one
    query position this is what decoding spends on attention: repeat_kv copied the whole cache every step (12 of a
    72 ms step of SmolLM2-135M, 16 rows of ~330 positions, on a 2-core AVX512-BF16 EPYC, 2026-11-28) and the
    score matmul read each key `groups` times. The same arithmetic as transformers' eager_attention_forward; what it
    does not do (a softcap, attention sinks, dropout while training, no grouping) goes to the model's own."""
    b, heads, q, d = query.shape
    groups = heads // key.shape[1]
    if groups == 1 or kwargs.get("softcap") is not None or "s_aux" in kwargs or (dropout and module.training):
        own = sys.modules[type(module).__module__].eager_attention_forward
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    kv, length = key.shape[1], key.shape[2]
    # (B x KV heads, T, D): the keys made contiguous, since CPU bmm takes a slow path for a batch of transposed
    # matrices strided as a growing cache's views are (490 us against 98 + 32 for the copy, at 48 x 400 x 64 in
    # bf16); the values' strided view is as fast as a copy and its bmm (103 us against 68 + 32)
    keys, values = key.reshape(b * kv, length, d).contiguous(), value.reshape(b * kv, length, d)
    stacked = query.reshape(b * kv, groups * q, d)  # each key/value head's query heads, stacked
    scores = torch.bmm(stacked, keys.transpose(1, 2)).view(b, kv, groups * q, length) * scaling
    if attention_mask is not None:  # (B, 1, q, >= T): the same for every head, so for each stacked group
        mask = attention_mask[:, :, :, :length]
        scores = scores + mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(b, mask.shape[1], groups * q, -1)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(weights.view(b * kv, groups * q, length), values).view(b, heads, q, d)  # (B, heads, q, D)
    return out.transpose(1, 2).contiguous(), weights.reshape(b, heads, q, -1)


GROUPED = "tunebench_grouped"  # grouped_attention's name in transformers' attention and mask registries
AttentionInterface.register(GROUPED, grouped_attention)
AttentionMaskInterface.register(GROUPED, eager_mask)  # the masks eager attention takes (additive, 4D)


@contextlib.contextmanager
def eager_attention(model, device: torch.device):
    """The model's eager attention while decoding on a CPU (see the module docstring), grouped_attention where its
    key/value heads are shared by several query heads; put back after."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    kept = [c._attn_implementation for c in configs]
    grouped = any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())
    if device.type == "cpu":
        for c in configs:
            c._attn_implementation = GROUPED if grouped else "eager"
    try:
        yield
    finally:
        for c, k in zip(configs, kept):
            c._attn_implementation = k


@contextlib.contextmanager
def whole_rows_to_head(model):
    """The output head given its input contiguous while decoding. A prefill asks for the last position's logits
    (logits_to_keep=1), so the head gets a strided (rows, 1, hidden) slice; where the head's weight needs no gradient
    (frozen under LoRA, as every sampled run's), torch.matmul then does not fold it into one matrix product but
    copies the weight once per row for a batched one: 16 rows of SmolLM2-135M copied 864 MB (54 MB a row) in each
    prefill, what a towns RFT step's sampling held beyond its plan (2026-12-04, the profiler's trace:
    linear -> matmul -> bmm -> contiguous of (16, 576, 49152); benchmarks/sampled-memory-epyc-2026-12-04/)."""
    head = methods.base_of(model).get_output_embeddings()
    hook = head.register_forward_pre_hook(_contiguous_input) if head is not None else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()


def _contiguous_input(module, args):
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def cache_keyword(model) -> str:
    """The name transformers' forward takes the KV cache by: `cache` from 5.24 (`past_key_values` deprecated
    there, to go in 5.40), `past_key_values` before; the output carries it under the same name."""
    return "cache" if "cache" in inspect.signature(methods.base_of(model).forward).parameters else "past_key_values"


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer with its keys and values held in buffers that grow by doubling: a token's update
    writes in place, where DynamicLayer's torch.cat copies the whole cache every token (at 16 rows x 450 positions
    of SmolLM2-135M in bf16, 166 MB a step). `keys` and `values` are views of the filled part, as DynamicLayer's."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self._keys, self._values = 0, None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            size = max(end, 2 * (0 if self._keys is None else self._keys.shape[-2]), 64)
            self._keys, self._values = (self._grown(old, new, size) for old, new in
                                        ((self._keys, key_states), (self._values, value_states)))
        self._keys[..., self.length:end, :] = key_states
        self._values[..., self.length:end, :] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def _grown(self, old: torch.Tensor | None, new: torch.Tensor, size: int) -> torch.Tensor:
        grown = new.new_empty((*new.shape[:-2], size, new.shape[-1]))
        if old is not None:
            grown[..., :self.length, :] = old[..., :self.length, :]
        return grown

    def _views(self) -> None:
        self.keys, self.values = self._keys[..., :self.length, :], self._values[..., :self.length, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._keys, self._values = (t.repeat_interleave(repeats, dim=0) for t in (self._keys, self._values))
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._keys, self._values = self._keys[indices, ...], self._values[indices, ...]
            self._views()


def growing_cache() -> DynamicCache:
    """A DynamicCache whose layers are GrowingLayers (made as the model's layers first update it)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


Each = Callable[[torch.Tensor], bool]  # called with each step's (B,) new tokens; True stops the decoding
CACHES = ("auto", "dynamic", "static")


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: int | None, pad: int,
           temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, each: Each | None = None,
           cache: str = "auto", repeat: int = 1) -> torch.Tensor:
    """(B x repeat, new) tokens after the left-padded prompts `ids` (attention `mask`), `repeat` rows of each
    prompt in a row (GRPO's group), padding after each row's EOS (eos None: every row runs max_new_tokens). On the
    dynamic cache each prompt is prefilled once and its cache repeated for its rows (transformers'
    batch_repeat_interleave). `each` sees the tokens as they come (a streamed reply) and may
    stop the decoding. The caller holds the model in eval mode under its autocast (inference.Placed.running).
    `cache`: "dynamic" (transformers' DynamicCache, eager steps), "static" (a StaticCache, its step replayed as a
    CUDA graph on a GPU, run eagerly elsewhere: the same tokens), "auto" (static on a GPU for GRAPH_MIN_TOKENS or
    more new tokens where the model supports it, dynamic elsewhere)."""
    if cache not in CACHES:
        raise ValueError(f"cache {cache!r} is not one of {', '.join(CACHES)}")
    if max_new_tokens <= 0:
        return ids.new_zeros((ids.shape[0], 0))
    if methods.is_prompt_learning(model) or cache == "static" or (cache == "auto" and ids.is_cuda):
        ids, mask, repeat = ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0), 1
    if methods.is_prompt_learning(model):
        return _by_generate(model, ids, mask, max_new_tokens, eos, pad, temperature, top_p, top_k, each)
    with whole_rows_to_head(model):  # both caches' prefills
        if cache == "static" or (cache == "auto" and ids.is_cuda and max_new_tokens >= GRAPH_MIN_TOKENS
                                 and static_ready(model)):
            steps = _static_steps(model, ids, mask, max_new_tokens)
            if steps is not None:
                return _run(steps, ids.shape[0], max_new_tokens, eos, pad, temperature, top_p, top_k, each, False)
        with eager_attention(model, ids.device):
            return _run(_dynamic_steps(model, ids, mask, repeat), ids.shape[0] * repeat, max_new_tokens, eos, pad,
                        temperature, top_p, top_k, each, True)


def _run(steps, rows: int, max_new_tokens: int, eos, pad, temperature, top_p, top_k, each, shrink: bool
         ) -> torch.Tensor:
    """The loop both caches share: `steps` yields the first logits, then is sent each step's tokens (of the rows
    it still decodes) and which of those rows go on (None: all), and yields their next logits. With `shrink`, a
    row that made its EOS leaves: `steps` is told to drop it."""
    started = time.perf_counter()
    logits = next(steps)
    PREFILL_S[0] += time.perf_counter() - started
    done = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    live = torch.arange(rows, device=logits.device)  # the rows `logits` holds, in order
    out = []
    recorded = _ENTROPIES[-1] if _ENTROPIES and temperature is not None else None
    if recorded is not None:
        summed, counted, first = (torch.zeros(rows, device=logits.device) for _ in range(3))
    for i in range(max_new_tokens):
        if recorded is not None:  # the rows still decoding: a finished row's token is padding
            on = (~done[live]).float()
            h = entropy(logits, temperature)
            summed[live] += h * on
            counted[live] += on
            if i == 0:
                first[live] = h
        drawn = sample_from(logits, temperature, top_p, top_k, live, rows)  # (len(live), 1)
        token = torch.full((rows, 1), pad, dtype=drawn.dtype, device=drawn.device)
        token[live] = torch.where(done[live, None], torch.full_like(drawn, pad), drawn)
        out.append(token)
        if eos is not None:
            done |= token[:, 0] == eos
        if (each is not None and each(token[:, 0])) or (eos is not None and bool(done.all())) \
                or i == max_new_tokens - 1:
            break
        keep = None
        if shrink and eos is not None and bool(done[live].any()):
            keep = ~done[live]
            live = live[keep]
        logits = steps.send((token[live], keep))
    steps.close()
    if recorded is not None:
        recorded.append((summed, counted, first))
    return torch.cat(out, 1)


def _dynamic_steps(model, ids, mask, repeat: int = 1):
    """Logits of the last position: the prompt's, then each fed token's (transformers' DynamicCache); each prompt
    prefilled once, its cache, mask and position repeated for its `repeat` rows."""
    kw = cache_keyword(model)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{kw: growing_cache()}, use_cache=True,
                 logits_to_keep=1)
    cache, logits = getattr(step, kw), step.logits[:, -1]
    last = positions[:, -1:]
    if repeat > 1:
        cache.batch_repeat_interleave(repeat)
        logits, mask, last = (t.repeat_interleave(repeat, 0) for t in (logits, mask, last))
    while True:
        token, keep = yield logits
        if keep is not None:  # finished rows leave: their cache rows, mask and positions with them
            index = keep.nonzero().squeeze(1)
            cache.batch_select_indices(index)
            mask, last = mask[index], last[index]
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        last = last + 1
        step = model(input_ids=token, attention_mask=mask, position_ids=last, **{kw: cache}, use_cache=True,
                     logits_to_keep=1)
        cache, logits = getattr(step, kw), step.logits[:, -1]


class Turns:
    """Decoding over the turns of the same rows (GRPO's episodes) with each row's KV cache kept between them: a
    row's context is fed once, then only what was appended to it since (the rest of its last reply and a tool
    turn); rows that share a context on their first turn (a group's opening) are prefilled once. A row's cache is
    kept compact (its real tokens only, padding dropped), laid side by side left-padded for each turn, and grown
    by the turn's dynamic cache; a row that made its EOS leaves the turn's batch, its cache kept for its next turn.
    Each step draws for every row of the turn (as `decode`), so the tokens are those of decoding each turn's whole
    contexts afresh: the same positions and attention, the logits within float rounding of the recomputation.
    Only plain DynamicCache layers are kept (a sliding-window layer drops its old keys): other models decode each
    turn's whole contexts."""

    def __init__(self):
        self.kept: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], int]] = {}  # row -> (layers, fed)
        self.plain = True  # False once a model's cache was not plain DynamicLayers: whole contexts each turn
        self.prefilled = 0  # the tokens fed to the model as context (not decoded): what keeping the cache saves

    @torch.no_grad()
    def decode(self, model, rows: list[int], contexts: list[list[int]], max_new_tokens: int, eos: int | None,
               pad: int, temperature: float | None = None, top_p: float = 1.0) -> torch.Tensor:
        """(len(rows), new) tokens after each row's whole context (`rows` the caller's ids for them, the same
        from turn to turn), as `decode` makes them from the left-padded contexts, padding after each EOS. A row
        not given is done: its cache is dropped."""
        device = model.device if hasattr(model, "device") else next(model.parameters()).device
        playing = set(rows)
        self.kept = {r: k for r, k in self.kept.items() if r in playing}
        if not self.plain or methods.is_prompt_learning(model):
            ids, mask = left_padded(contexts, pad, device)
            self.prefilled += int(mask.sum())
            return decode(model, ids, mask, max_new_tokens, eos, pad, temperature, top_p, cache="dynamic")
        with eager_attention(model, device), whole_rows_to_head(model):
            self._prefill(model, [(r, c) for r, c in zip(rows, contexts) if r not in self.kept], pad, device)
            if not self.plain:
                return self.decode(model, rows, contexts, max_new_tokens, eos, pad, temperature, top_p)
            return _run(self._steps(model, rows, contexts, pad, device), len(rows), max_new_tokens, eos, pad,
                        temperature, top_p, 0, None, True)

    def _prefill(self, model, new: list[tuple[int, list[int]]], pad: int, device) -> None:
        """Each new row's context but its last token, fed once per distinct context, kept compact."""
        if not new:
            return
        distinct = list(dict.fromkeys(tuple(c[:-1]) for _, c in new))
        kw = cache_keyword(model)
        ids, mask = left_padded([list(c) for c in distinct], pad, device)
        self.prefilled += int(mask.sum())
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    **{kw: DynamicCache()}, use_cache=True, logits_to_keep=1)
        cache = getattr(out, kw)
        if not all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers):
            self.plain = False
            return
        where = {c: i for i, c in enumerate(distinct)}
        for row, context in new:
            self._keep(row, cache, where[tuple(context[:-1])], mask)

    def _keep(self, row: int, cache, i: int, mask: torch.Tensor) -> None:
        real = mask[i].bool()
        self.kept[row] = ([(layer.keys[i][:, real], layer.values[i][:, real]) for layer in cache.layers],
                          int(real.sum()))

    def _steps(self, model, rows, contexts, pad: int, device):
        """_dynamic_steps' generator over the kept caches: the first logits after feeding each row what its cache
        lacks; a row leaving (or the turn ending) has its cache kept."""
        kw = cache_keyword(model)
        fed = [self.kept[r][1] for r in rows]
        width = max(fed)
        cache = growing_cache()
        for j in range(len(self.kept[rows[0]][0])):  # each layer's kept rows, left-padded side by side
            keys, values = (torch.stack([F.pad(self.kept[r][0][j][k], (0, 0, width - n, 0))
                                         for r, n in zip(rows, fed)]) for k in (0, 1))
            cache.update(keys, values, j)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in fed], device=device)
        chunks = [c[n:] for c, n in zip(contexts, fed)]
        ids, chunk_mask = left_padded(chunks, pad, device)
        self.prefilled += int(chunk_mask.sum()) - len(rows)  # the last token of each context is fed as decoding's
        positions = torch.tensor(fed, device=device)[:, None] + (chunk_mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([mask, chunk_mask], 1)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{kw: cache}, use_cache=True,
                     logits_to_keep=1)
        cache, logits, last = getattr(step, kw), step.logits[:, -1], positions[:, -1:]
        live = list(rows)
        try:
            while True:
                token, keep = yield logits
                if keep is not None:  # rows that made their EOS leave the turn: their caches kept for the next
                    for i in (~keep).nonzero().squeeze(1).tolist():
                        self._keep(live[i], cache, i, mask)
                    index = keep.nonzero().squeeze(1)
                    cache.batch_select_indices(index)
                    mask, last = mask[index], last[index]
                    live = [live[i] for i in index.tolist()]
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                last = last + 1
                step = model(input_ids=token, attention_mask=mask, position_ids=last, **{kw: cache}, use_cache=True,
                             logits_to_keep=1)
                cache, logits = getattr(step, kw), step.logits[:, -1]
        finally:  # the turn ended: the rows still in it keep what they were fed
            for i, row in enumerate(live):
                self._keep(row, cache, i, mask)


def left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token lists, left-padded to the longest: what `decode` and Turns take."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def static_ready(model) -> bool:
    """Whether transformers says the model's forward runs with a StaticCache and no host sync (its
    _can_compile_fullgraph) and its attention takes a 4D mask (sdpa or eager)."""
    base = methods.base_of(model)
    return bool(getattr(base, "_can_compile_fullgraph", False)) and \
        base.config._attn_implementation in ("sdpa", "eager")


def _static_steps(model, ids, mask, max_new_tokens: int):
    """`_dynamic_steps` over a StaticCache, its one-token step a CUDA graph on a GPU; None (said once) where
    the model cannot run it, before any token is made."""
    base = methods.base_of(model)
    rows, width = ids.shape
    kw = cache_keyword(model)
    cache = StaticCache(config=base.config, max_cache_len=width + max_new_tokens)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    first = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{kw: cache}, use_cache=True,
                  logits_to_keep=1).logits[:, -1]
    # The step's inputs, updated in place: the fed token, its position, which cache slots it attends to.
    token = ids.new_full((rows, 1), 0)
    position = positions[:, -1:].clone()
    seen = torch.zeros(rows, width + max_new_tokens, dtype=torch.bool, device=ids.device)
    seen[:, :width] = mask.bool()
    eager = base.config._attn_implementation == "eager"
    dtype = base.get_input_embeddings().weight.dtype

    def step() -> torch.Tensor:
        attend = seen[:, None, None, :]
        if eager:  # eager attention adds its mask; sdpa takes the booleans
            attend = torch.zeros((), dtype=dtype, device=ids.device).masked_fill(~attend, torch.finfo(dtype).min)
        return model(input_ids=token, attention_mask=attend, position_ids=position, **{kw: cache}, use_cache=True,
                     logits_to_keep=1).logits[:, -1]

    run = step
    if ids.is_cuda:
        run = _captured(step, cache)
        if run is None:
            return None
    return _static_loop(first, run, token, position, seen, width)


def _static_loop(first, run, token, position, seen, width: int):
    fed, _ = yield first  # every row, always (_run does not shrink a static cache)
    while True:
        token.copy_(fed)
        position.add_(1)
        seen[:, width] = True
        width += 1
        fed, _ = yield run()


_said: set[str] = set()


def _eager_because(reason: str) -> None:
    """Say once per process why decoding on this GPU stays eager."""
    if reason not in _said:
        _said.add(reason)
        log.warning("decoding eagerly: %s", reason)


def _captured(step, cache) -> _Replay | None:
    """`step` captured as a CUDA graph, replayed by the callable returned; None (the reason logged) where capture
    fails. PyTorch wants one run before capture, on a side stream: it writes the cache's next slot (rewritten by
    the first real step) and advances the cache's write position, which is put back."""
    layers = getattr(cache, "layers", [])
    if not layers or not all(isinstance(getattr(x, "cumulative_length", None), torch.Tensor) for x in layers):
        return _eager_because("this transformers' StaticCache keeps no write position to restore")
    kept = [x.cumulative_length.clone() for x in layers]
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype is not None, cache_enabled=False)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast:
            step()
        torch.cuda.current_stream().wait_stream(side)
        for x, k in zip(layers, kept):
            x.cumulative_length.copy_(k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), autocast:
            logits = step()
    except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager loop, which works everywhere
        return _eager_because("the one-token step could not be captured as a CUDA graph "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    return _Replay(graph, logits, step, cache)


class _Replay:
    """A captured step, replayed by calling it. It holds the cache and the step (whose closure holds its input
    buffers): a CUDA graph reads and writes those tensors' memory but keeps none of them alive, and once freed
    the allocator hands that memory to other tensors (a gpt2-124m decode then wrote past its cache: an H100's
    index_copy_ assert, 2026-11-27)."""

    def __init__(self, graph, logits: torch.Tensor, step, cache):
        self.graph, self.logits, self.step, self.cache = graph, logits, step, cache

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


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
