"""Hand-written fast paths that transformers and torch do not offer as such.

`linear_cross_entropy_sum` is the output head and the loss in one: it never holds the (N, V)
logits of all loss positions, only those of some hundreds of rows at a time, and it writes their
gradient over them while they are still in cache (see its docstring). `cross_entropy_sum` is the
same loss for logits that a model has already made.

`causal_attention` is registered with transformers as the attention implementation "tunebench"
and competes with "eager" and "sdpa" in the per-run measurement (`finetune.pick_attention`).
For the causal, unmasked case that training on right-padded rows is (see `objective.loss_sum`), it
runs grouped-query attention without copying keys and values per query head: the query heads
that share a key head are stacked into one matrix, so each product is one batched matmul, the
causal mask and the scale ride inside `baddbmm`, and the backward has no head-sum. Anything else
(a padding or block mask, a KV cache, a model with its own attention quirks) goes to transformers'
SDPA path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
        probs = fast_dropout(probs, dropout) if probs.device.type == "cpu" else F.dropout(probs, p=dropout)
    out = torch.bmm(probs, v).view(batch, heads, length, dim)
    return out.transpose(1, 2).contiguous(), None


def fast_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout whose CPU keep mask costs a quarter of torch's (see kernels.FastDropout): each 64-bit
    draw yields four 16-bit uniforms; p is quantised to 1/65536 and the scale matches it exactly."""
    kept = 1.0 - round(p * 65536) / 65536
    n = x.numel()
    words = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)
    keep = words.view(torch.int16)[:n].view(x.shape) >= round(p * 65536) - 32768
    return x * keep * (1.0 / kept)


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


def _cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor | None,
                        rows: int) -> torch.Tensor:
    """Summed cross-entropy of (N, V) logits in fp32, `rows` rows at a time so the fp32 copies stay
    in cache. With `grad` (N, V), which may be `logits` itself, also d(sum)/d(logits) =
    softmax - onehot, written in grad's dtype: the gradient comes out of the same pass as the loss."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for i in range(0, logits.shape[0], rows):
        x = logits[i : i + rows].to(torch.float32, copy=True)  # (rows, V)
        t = targets[i : i + rows, None]
        picked = x.gather(1, t)
        top = x.amax(dim=-1, keepdim=True)
        e = x.sub_(top).exp_()
        norm = e.sum(dim=-1, keepdim=True)
        total += (top + norm.log() - picked).sum()
        if grad is not None:
            e.div_(norm).scatter_add_(1, t, torch.full_like(picked, -1.0))
            grad[i : i + rows].copy_(e)
    return total


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int, grad_enabled: bool) -> torch.Tensor:
        grad = torch.empty_like(logits) if grad_enabled and ctx.needs_input_grad[0] else None
        total = _cross_entropy_rows(logits, targets, grad, rows)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """F.cross_entropy(logits.float(), targets, reduction="sum") without an fp32 copy of all logits.

    Kept between forward and backward: the gradient, in the logits' dtype (as autograd would keep
    the logits). For models whose logits need more than a matmul; the others take
    `linear_cross_entropy_sum`."""
    return _CrossEntropy.apply(logits, targets, rows, torch.is_grad_enabled())


# The loss rows are padded to a multiple of this. oneDNN, which runs a CPU's matmuls, builds and caches a kernel
# for every new shape (up to 1,024 of them), and the head's (rows, hidden) x (hidden, vocabulary) ones are large:
# a row count that differed at every step kept adding to a run's memory (SmolLM2-shaped LoRA, 84 steps: 1.17 ->
# 1.70 GB and growing); padded, it stays at 1.25 GB from the second step. (Padding a batch's width as well
# changed the body's numerics against HF's unpadded runs, QLoRA's losses by 2e-4, and was not needed.)
SHAPE_MULTIPLE = 64


def _padded_rows(x: torch.Tensor, multiple: int = SHAPE_MULTIPLE) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype: torch.dtype, chunk: int, rows: int, grad_enabled: bool):
        # (needs_input_grad says True under no_grad too: evaluation would make gradients for nothing)
        need_h, need_w, need_b = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        n = hidden.shape[0]
        h, w = _padded_rows(hidden.to(dtype)), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_h = torch.empty_like(h, dtype=hidden.dtype) if need_h else None  # (N padded, H)
        grad_w = grad_b = None  # fp32 sums of the chunks' (V, H) and (V,) products
        want = need_h or need_w or need_b
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, h.shape[0], chunk):
            logits = F.linear(h[i : i + chunk], w, b)  # (chunk, V), overwritten by its own gradient
            real = min(logits.shape[0], n - i)  # the rows past n are padding: no loss, a zero gradient
            total += _cross_entropy_rows(logits[:real], targets[i : i + real], logits[:real] if want else None, rows)
            if want:
                logits[real:].zero_()
            if need_h:
                grad_h[i : i + chunk] = logits @ w
            if need_w:
                part = logits.t() @ h[i : i + chunk]  # (V, H)
                grad_w = part.float() if grad_w is None else grad_w.add_(part)
            if need_b:
                part = logits.sum(dim=0, dtype=torch.float32)
                grad_b = part if grad_b is None else grad_b.add_(part)
        if need_h:
            grad_h = grad_h[:n]
        if need_w and grad_w is None:  # no rows
            grad_w = torch.zeros_like(weight, dtype=torch.float32)
        if need_b and grad_b is None:
            grad_b = torch.zeros_like(bias, dtype=torch.float32)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # Scaled in place: each gradient the forward made is read by this one backward (a second one, under
        # retain_graph, is refused by autograd's check of the saved tensors' versions), and a fresh copy of a
        # tied 50k x 768 weight's gradient cost 58 ms against 7 for the 154 MB in place, on a 2-core CPU.
        grads = [None if g is None else g.mul_(grad_out).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return *grads, None, None, None, None, None


# Logits made at a time, in bytes: on a CPU, a chunk that stays in the last-level cache between the matmul,
# the loss pass and the gradient matmul; on a GPU, bigger chunks keep the kernels busy.
_CHUNK_BYTES = {"cpu": 24 * 2**20, "cuda": 256 * 2**20}
# But never fewer rows than this, whatever the bytes: a thin matmul is far from the CPU's rate. On the 2-core
# AVX2 CPU, in fp32, where 24 MB of a 49k vocabulary is 128 rows, the head and loss (forward and backward of
# 508 rows) took 527-542 ms in 128-row chunks and 421-427 in 512-row ones (106 -> 136 GFLOP/s), for 75 MB
# more held. A large vocabulary's chunk is then past the cache, and the matmuls' rate is worth more.
_MIN_CHUNK_ROWS = 512
# Bytes of fp32 logits per loss pass inside a chunk: a few MB on a CPU, next to the chunk in the same cache
# (32 rows of a 49k vocabulary). A pass is ~10 small ops, so a small vocabulary takes many rows a pass: at
# 128 tokens, 32-row passes made 24 passes of a 12 x 64 batch.
_LOSS_BYTES = {"cpu": 6 * 2**20, "cuda": 192 * 2**20}
# When the head itself trains (full fine-tuning), every chunk adds a (V, H) product to its gradient:
# chunks of at least this many rows keep those passes few (one up to 4,096 loss positions).
_WEIGHT_GRAD_ROWS = 4096


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Summed cross-entropy of F.linear(hidden, weight, bias) computed in `dtype`, loss in fp32.

    Exactly the output head and `cross_entropy_sum`, but the (N, V) logits exist only a chunk of
    rows at a time: each chunk's gradient is made in the forward, while its logits are in cache, and
    turned into the gradient of the hidden states (N, H) at once; the backward only scales what the
    forward kept. At 4 x 2048 loss positions and a 49k vocabulary that is 0.8 GB of bf16 logits not
    held until the backward, and as much again for their gradient; on the development CPU the head
    and loss run 1.23-1.33x faster (8,192 and 896 rows, paired), a ~4% faster LoRA step.
    """
    item = torch.finfo(dtype).bits // 8
    budget = _CHUNK_BYTES.get(hidden.device.type, _CHUNK_BYTES["cuda"])
    chunk = max(_MIN_CHUNK_ROWS, budget // (weight.shape[0] * item))
    if weight.requires_grad and torch.is_grad_enabled():
        chunk = max(chunk, _WEIGHT_GRAD_ROWS)
    rows = max(16, _LOSS_BYTES.get(hidden.device.type, _LOSS_BYTES["cuda"]) // (weight.shape[0] * 4))
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, dtype, chunk, rows, torch.is_grad_enabled())


class FastDropout(torch.nn.Dropout):
    """LoRA dropout whose CPU keep mask costs a quarter of torch's.

    torch's CPU generator spends about 2 ns on every random number, and LoRA draws one mask per
    target module per step. Here each 64-bit draw yields four 16-bit uniforms, so p is quantised
    to 1/65536 (0.1 -> 0.100006) and the kept values are scaled by 1 / (1 - that p), which keeps
    the expectation exact. The same draw is kept under torch.compile: the compiler's own CPU
    dropout draws one number per element and made compiled layers slower than eager ones (0.98x),
    where this one lets them gain (1.19x, paired). On GPUs torch's fused dropout is already cheap
    and is used as is.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return super().forward(x)
        return fast_dropout(x, self.p)


def use_fast_dropout(model, within: str | None = None) -> int:
    """Swap every plain torch Dropout (under modules named `within`, when given) for FastDropout; return how many.

    Modules that read `.p` (GPT-2's attention hands `attn_dropout.p` to the attention kernel) still
    find it: FastDropout is a Dropout."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}"
            if type(child) is torch.nn.Dropout and child.p > 0 and (within is None or within in full):
                setattr(parent, name, FastDropout(child.p))
                swapped += 1
    return swapped
