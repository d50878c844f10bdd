"""The memory plan: a training step's peak memory predicted from the model's shape, the method, the precision, the
micro batch, the sequence length and gradient checkpointing, before a weight loads.

peak = runtime + weights + trainable state + activations, where
- runtime is what the process holds before the model (Python, torch, the tokenizer, the data; on a GPU nothing:
  the figures there are torch's allocations, as the run's own peak is);
- weights are the parameters as the method holds them: a frozen base in the compute dtype, a full fine-tune's fp32
  master weights, QLoRA's 4-bit blocks (and the rest in 16 bits: methods.prepare_for_kbit);
- trainable state is each trained parameter's gradient and AdamW's two moments (4 + 8 bytes);
- activations are the tensors autograd keeps for the backward pass, per token and layer, plus one layer's worth
  again while the backward pass runs through it (and, with checkpointing, recomputes it), times TRANSIENT (by
  device type) for the backward pass's own gradients and the allocator's kept blocks.

No library predicts this (accelerate's estimate counts weights and Adam only), so the per-token coefficients are
counted: autograd's saved-tensor hooks on Llama blocks in each method and precision gave the bytes each token
keeps per layer as a linear function of the hidden width h, the key/value width kv and the FFN width f
(tests/test_memory_plan.py counts them again and holds the coefficients to them). They are Llama's; other
families (GPT-2's LayerNorm and GELU) are planned with the same coefficients and said to be.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tunebench.core.decision import Decision

MB = 2**20
# bytes a token keeps per layer, as (per h, per kv, per f), sdpa attention, LoRA on q/v with dropout
ADAPTER = {2: (20.0, 4.0, 6.0), 4: (32.0, 8.0, 12.0)}  # frozen base in the compute dtype (bytes per value)
FULL = {2: (37.0, 4.0, 8.0), 4: (40.0, 8.0, 16.0)}  # fp32 master weights, under a 16-bit autocast or in fp32
CHECKPOINTED = 2.5  # x h x bytes per value: a checkpointed layer keeps its input (and the hook's bookkeeping)
# What the step's peak holds beyond the tensors autograd keeps: the backward pass's gradients of them and the
# blocks the allocator keeps freed for the next micro batch, as a factor on the kept activations, by device type.
# CPU: measured against the training loop's peak RSS on 2 AMX cores, bf16 LoRA at 128 tokens: 0.39-0.94 of the kept
# activations over six runs (0.135B, 0.42B and 1.07B, micro batch 2, 4 and 8), 1.6 in all. GPU: the peak is
# torch's live allocations (the allocator's kept blocks are not in it) and sdpa runs flash kernels; on an H100
# (2026-11-27, SmolLM2-1.7B's shape, 2,048 tokens, micro 4, bf16) the loop's peak made the factor 0.96 for LoRA and
# 0.94 for full fine-tuning, 1.0 in all (the CPU's 1.6 read 56% and 34% high there). An MPS run is planned as a CPU's.
TRANSIENT = {"cpu": 1.6, "cuda": 1.0}
# What a step holds with its layers compiled (torch.compile, regional: compiler.compile_blocks), as a factor on the
# eager activations above, by device type. Inductor's partitioner recomputes a layer's cheap elementwise ops in the
# backward pass instead of keeping their outputs, and its fused backward kernels make fewer intermediates. CPU:
# each step's peak RSS, eager against compiled, less the weights, state and runtime (SmolLM2-135M's shape, fp32,
# 2 AVX2 cores, 2026-12-03): LoRA q/v at 4 x 733 tokens 0.57 (a GRPO run of the towns benchmark, the same rows:
# 3,868 MB compiled, 5,844 eager, 0.59), LoRA on every linear layer at 4 x 512 0.53, full at 4 x 512 0.65; the
# plan counted eager's, 1.6x what the compiled GRPO run held. In bf16 (2 cores of an Intel Xeon with AVX512-BF16,
# 2026-12-03): LoRA q/v at 4 x 733 0.53, every linear layer at 4 x 512 0.57. GPU: not measured, eager's kept.
COMPILED = {"cpu": 0.6, "cuda": 1.0}
QLORA_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # nf4 with double quantization: 4 bits, an 8-bit absmax per 64, fp32 per 256
STATE_BYTES = 4 + 8  # a trained parameter's gradient (fp32) and AdamW's two moments


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads from a model's config and parameters."""

    layers: int
    hidden: int
    kv: int  # the key/value projections' width: key/value heads x head size
    ffn: int
    heads: int
    linear: int  # parameters in the blocks' linear layers (what QLoRA quantizes)
    other: int  # every other parameter: embeddings, norms, the output head
    family: str

    @property
    def params(self) -> int:
        return self.linear + self.other


def shape_of(model) -> ModelShape:
    """A model's shape, from its config and its parameters (real, or on the meta device)."""
    import torch

    c = model.config
    c = getattr(c, "get_text_config", lambda: c)()
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
                 for p in m.parameters(recurse=False) if id(p) not in head_ids and p.dim() == 2)
    total = sum(p.numel() for p in model.parameters())
    return ModelShape(layers, hidden, kv_heads * head_dim, ffn, heads, linear, total - linear,
                 getattr(c, "model_type", "unknown"))


def on_meta(config) -> ModelShape:
    """The shape of the model `config` describes, without its weights (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return shape_of(AutoModelForCausalLM.from_config(config))


def runtime_mb(device_type: str) -> float:
    """What the process holds before the model: its resident memory on a CPU; nothing on a GPU, whose figures
    are torch's allocations."""
    if device_type == "cuda":
        return 0.0
    import psutil

    return psutil.Process().memory_info().rss / MB


def lora_params(shape: ModelShape, r: int, targets: str) -> int:
    """A LoRA's parameters on `targets` ("q_proj,v_proj"-like names, or all-linear), r x (in + out) per layer."""
    widths = {"q_proj": (shape.hidden, shape.hidden), "k_proj": (shape.hidden, shape.kv),
              "v_proj": (shape.hidden, shape.kv), "o_proj": (shape.hidden, shape.hidden),
              "gate_proj": (shape.hidden, shape.ffn), "up_proj": (shape.hidden, shape.ffn),
              "down_proj": (shape.ffn, shape.hidden)}
    names = list(widths) if targets in ("all-linear", "all") else [t.strip() for t in targets.split(",")]
    per_layer = sum(r * sum(widths.get(n, (shape.hidden, shape.hidden))) for n in names)
    return per_layer * shape.layers


@dataclass(frozen=True)
class MemoryPlan:
    """A step's predicted peak, in MB, by part."""

    runtime: float
    weights: float
    state: float
    activations: float
    micro: int
    tokens: int
    checkpointing: bool
    note: str = ""
    rows_each: int = 1  # the rows a unit collates into: `micro` counts rows (a preference pair is 2)
    logits: float = 0.0  # an objective's log-probabilities over the vocabulary at its loss positions (with_logits)
    loss_positions: int = 0
    learned: float = 0.0  # what this machine's runs held beyond their plans (with_learned)
    learned_from: int = 0  # the runs that figure is the median of
    compiled: float = 1.0  # the factor on the activations of compiled layers (COMPILED), 1 when eager
    sampling: float = 0.0  # the KV caches a step that samples holds while it decodes (with_sampling)
    square: float = 0.0  # the part of `activations` that grows with the square of the width (attention's weights)
    sampling_rows: int = 0  # the episodes it decodes at once

    @property
    def total(self) -> float:
        """The peak: what the step keeps throughout, and the larger of its training pass and its sampling (a step
        that samples frees its caches before its forward and backward)."""
        return self.runtime + self.weights + self.state + max(self.activations + self.logits, self.sampling) + \
            self.learned

    def parts(self) -> str:
        gb = lambda mb: f"{mb / 1024:.1f} GB" if mb >= 1024 else f"{mb:.0f} MB"  # noqa: E731
        rows = f"micro {self.micro}" if self.rows_each == 1 else \
            f"{self.micro} rows: micro {self.micro // self.rows_each} x {self.rows_each}"
        compiled = f", compiled: x {self.compiled:g} of eager's" if self.compiled != 1.0 else ""
        acts = (f"activations {gb(self.activations)} ({rows} x {self.tokens} tokens, checkpointing "
                f"{'on' if self.checkpointing else 'off'}{compiled})")
        runtime = f" + runtime {gb(self.runtime)}" if self.runtime else ""
        logits = (f" + log-probabilities {gb(self.logits)} ({self.loss_positions:,} loss positions x the vocabulary)"
                  if self.logits else "")
        learned = (f" + {gb(self.learned)} that the last {self.learned_from} run(s) of this machine held beyond "
                   "their plans (the median)" if self.learned else "")
        training = f"{acts}{logits}"
        if self.sampling:
            training = (f"the larger of the training pass ({training}) and sampling's KV caches "
                        f"{gb(self.sampling)} ({self.sampling_rows} episodes x {self.tokens} tokens)")
        return (f"weights {gb(self.weights)} + trainable state {gb(self.state)} + {training}{runtime}{learned}"
                f"{self.note}")

    def as_fed(self, rows: int, width: int, loss_positions: int | None = None) -> float:
        """The predicted peak had the largest micro batch been `rows` x `width` (and held `loss_positions`, where
        given) instead of the plan's rows x tokens: activations scale with the positions a step holds (the
        attention weights an eager or tunebench kernel keeps, with positions x width), the log-probabilities with
        the loss positions, sampling's caches with the width (the episodes decoded are as many whatever was kept).
        GRPO plans every group teaching, at the longest completion; it feeds only the groups that teach."""
        planned = self.micro * self.tokens
        if not planned:
            return self.total
        logits = self.logits * loss_positions / self.loss_positions if self.loss_positions and \
            loss_positions is not None else self.logits
        share = rows * width / planned
        training = (self.activations - self.square) * share + self.square * share * width / self.tokens + logits
        return self.runtime + self.weights + self.state + max(training, self.sampling * width / self.tokens) + \
            self.learned


def vocab_of(model) -> int:
    """The rows of a model's output head (its vocabulary), under PEFT too."""
    c = model.config
    return int(getattr(c, "get_text_config", lambda: c)().vocab_size)


def with_logits(plan: MemoryPlan, loss_positions: int, vocab: int) -> MemoryPlan:
    """`plan` with an objective's fp32 log-probabilities over the vocabulary at a micro batch's `loss_positions`
    (preference.token_logps: DPO's, ORPO's, KTO's): kept for the backward pass, then its gradient and the logits'
    at the peak, three (N, V) tensors. The next-token loss of SFT fuses head and loss and never holds them.
    DPO at micro 4 pairs x 256 tokens on SmolLM2 peaked 870 MB over a plan without them (2026-12-02, AVX2)."""
    return dataclasses.replace(plan, logits=3 * 4 * loss_positions * vocab / MB, loss_positions=loss_positions)


CACHE_COPIES = 3  # a row's KV cache is held at most this many times while a turn decodes (decoding.Turns)


def with_sampling(plan: MemoryPlan, shape: ModelShape, rows: int, value_bytes: int) -> MemoryPlan:
    """`plan` with the KV caches of a step that samples `rows` episodes at once, each as long as the plan's rows
    (`plan.tokens`): keys and values of every layer, CACHE_COPIES times. Why three: decoding.Turns keeps each row's
    cache compact between turns, lays them side by side (left-padded) for the turn, and copies each row's out
    again when the turn ends, before the turn's cache is freed. An RFT step on a 2-core Xeon (SmolLM2-135M fp32,
    16 episodes, contexts ~400-700 tokens, gradient checkpointing on) grew its resident memory ~1.0 GB while it
    sampled and ~0.35 GB more in its training pass; the plan held neither (2026-12-04,
    benchmarks/sampled-memory-xeon-2026-12-04/)."""
    kv = CACHE_COPIES * rows * plan.tokens * shape.layers * 2 * shape.kv * value_bytes
    return dataclasses.replace(plan, sampling=kv / MB, sampling_rows=rows)


def with_learned(plan: MemoryPlan, beyond: tuple[float, int] | None) -> MemoryPlan:
    """`plan` with what this machine's last runs held beyond their plans (plancheck.memory_beyond: the median, how
    many runs), where that is more than nothing. Never less: the plan stays a bound where runs held less. A bf16
    run on an AVX512-BF16 CPU grew ~400 MB over its first steps' new shapes that no part above counts
    (SmolLM2-135M LoRA, 2026-12-02: 1,289-1,348 MB against plans of 800-1,099)."""
    if beyond is None or beyond[0] <= 0:
        return plan
    return dataclasses.replace(plan, learned=beyond[0], learned_from=beyond[1])


def predict(shape: ModelShape, method: str, value_bytes: int, trainable: int, micro: int, tokens: int,
            checkpointing: bool, attention: str = "sdpa", runtime_mb: float = 0.0,
            weight_bytes: float | None = None, device_type: str = "cpu", adapter_bytes: float = 0.0) -> MemoryPlan:
    """The plan for one training step. `value_bytes`: 2 under a 16-bit precision, 4 in fp32. `weight_bytes`: the
    weights as they are held, when known (a loaded model); else from the method. `adapter_bytes`: what LoRA
    modules beyond q/v keep a token in a layer (adapter_inputs)."""
    transient = TRANSIENT.get(device_type, TRANSIENT["cpu"])
    full = method == "full"
    if weight_bytes is None:
        if full:
            weight_bytes = 4.0 * shape.params
        elif method == "qlora":  # the blocks quantized; the embeddings and head kept 16-bit (methods.prepare_for_kbit)
            weight_bytes = QLORA_BYTES * shape.linear + 2.0 * shape.other + 4.0 * trainable
        else:
            weight_bytes = value_bytes * shape.params + 4.0 * trainable
    h, kv, f = (FULL if full else ADAPTER)[value_bytes]
    per_token_layer = h * shape.hidden + kv * shape.kv + f * shape.ffn + (0.0 if full else adapter_bytes)
    square = 0.0  # bytes a token keeps in a layer that grow with the width: the attention weights
    if attention == "eager":  # the softmax's probabilities, kept by it and by the product with the values
        square = 2 * value_bytes * shape.heads * tokens
    elif attention == "tunebench":  # model/kernels.py's keeps its softmax in the compute dtype (T x T a head) where
        # sdpa, which the coefficients count, keeps its output and an fp32 log-sum-exp a head instead
        square = value_bytes * shape.heads * tokens
        per_token_layer -= value_bytes * shape.hidden + 4 * shape.heads
    per_token_layer += square
    n = micro * tokens
    # held whole: with checkpointing one layer's activations while it is recomputed, else every layer's and the
    # one the backward pass is in
    layers = 1 if checkpointing else shape.layers + 1
    kept = transient * per_token_layer * n * layers
    if checkpointing:  # and each layer's input
        kept += CHECKPOINTED * value_bytes * shape.hidden * n * shape.layers
    if full and value_bytes == 2:  # autocast's 16-bit copies of the fp32 weights, kept for the backward pass
        kept += 2.0 * shape.linear / (shape.layers if checkpointing else 1)  # (one layer's while it is recomputed)
    state = STATE_BYTES * trainable
    note = "" if shape.family in ("llama", "mistral", "qwen2", "qwen3", "smollm3") else \
        f"; activations as a Llama of this width ({shape.family} counted alike)"
    return MemoryPlan(runtime_mb, weight_bytes / MB, state / MB, kept / MB, micro, tokens, checkpointing, note,
                      square=transient * square * n * layers / MB)


def when_compiled(plan: MemoryPlan, device_type: str) -> MemoryPlan:
    """`plan` with its layers compiled: the activations at COMPILED's factor for the device type."""
    factor = COMPILED.get(device_type, 1.0)
    return dataclasses.replace(plan, activations=plan.activations * factor, square=plan.square * factor,
                               compiled=factor)


def adapter_inputs(model, value_bytes: int, layers: int) -> float:
    """Bytes a token keeps in a layer (the mean over layers) for the LoRA modules the coefficients above leave out:
    every one but q_proj and v_proj. Each keeps its dropped-out input for its A's gradient and the dropout's mask,
    both in the compute dtype (as autograd's saved-tensor hooks count them), or with no dropout nothing beyond the
    shared input, and the r-wide input of its B. LoRA on every linear layer of SmolLM2-135M in fp32 at micro 4 x 551
    tokens (our attention kernel) peaked at 10.9 GB against a plan of 5.0 that counted neither (2026-12-02, AVX2)."""
    kept = 0.0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "v_proj") or not hasattr(module, "lora_A"):
            continue
        for adapter, down in module.lora_A.items():
            dropout = module.lora_dropout[adapter] if adapter in module.lora_dropout else None
            dropped = getattr(dropout, "p", 0.0) > 0
            kept += (2 * down.in_features * value_bytes if dropped else 0) + down.out_features * value_bytes
    return kept / layers if layers else 0.0


def held_mb(model, extra=()) -> float:
    """The bytes of `model`'s parameters as held, and of `extra`'s that are not the model's, in MB."""
    own = {id(p) for p in model.parameters()}
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return (held + sum(p.numel() * p.element_size() for p in extra if id(p) not in own)) / MB


def of_step(model, extra, micro: int, tokens: int, value_bytes: int, attention: str, runtime: float,
            device_type: str, rows_each: int = 1, compiled: bool = False) -> MemoryPlan:
    """The plan of a built model's step: its parameters' bytes as held (and those of `extra`, such as a full
    fine-tune's frozen reference copy), its trained parameters, the chosen micro batch (of units, each `rows_each`
    rows), kernel, checkpointing and compilation.
    A model that trains most of its parameters is planned as a full fine-tune (fp32 weights under autocast)."""
    from tunebench.training.autotune.probe import checkpointing_on

    held = held_mb(model, extra) * MB
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    full = trainable > sum(p.numel() for p in model.parameters()) / 2
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT
    shape = shape_of(model)
    plan = predict(shape, "full" if full else "lora", value_bytes, trainable, micro * rows_each, tokens,
                   checkpointing_on(base), attention, runtime, held, device_type,
                   adapter_inputs(model, value_bytes, shape.layers) if not full else 0.0)
    plan = when_compiled(plan, device_type) if compiled else plan
    return dataclasses.replace(plan, rows_each=rows_each)


def row(plan: MemoryPlan, free_mb: float | None, device_type: str) -> Decision:
    peak = "GPU memory (torch's allocations)" if device_type == "cuda" else "resident memory"
    room = f"; {free_mb / 1024:.1f} GB free" if free_mb is not None else ""
    return Decision("memory_plan", f"{plan.total / 1024:.1f} GB",
                    f"predicted peak {peak} of a step: {plan.parts()}{room}")


def refusal(plan: MemoryPlan, free_mb: float, what: str, fix: str) -> str | None:
    """The one-line refusal when even the smallest step (micro 1, checkpointing on) cannot fit, else None."""
    if plan.total <= free_mb:
        return None
    return (f"{what} needs about {plan.total / 1024:.1f} GB to train ({plan.parts()}) and "
            f"{free_mb / 1024:.1f} GB is free; {fix}")


def smallest(shape: ModelShape, method: str, value_bytes: int, trainable: int, tokens: int, runtime_mb: float,
             device_type: str) -> MemoryPlan:
    """The least a run of this model and method can take: micro batch 1, gradient checkpointing on."""
    return predict(shape, method, value_bytes, trainable, 1, tokens, True, runtime_mb=runtime_mb,
                   device_type=device_type)


def check_fits(shape: ModelShape, what: str, method: str, value_bytes: int, lora_r: int, targets: str, tokens: int,
               free_mb: float, device_type: str, runtime_mb: float) -> tuple[MemoryPlan, str | None]:
    """(the smallest step's plan, the refusal when even it does not fit `free_mb`, with the method that would)."""
    adapter = lora_params(shape, lora_r, "q_proj,v_proj" if targets == "auto" else targets)
    trainable = lambda m: shape.params if m == "full" else adapter  # noqa: E731
    plan = smallest(shape, method, value_bytes, trainable(method), tokens, runtime_mb, device_type)
    if plan.total <= free_mb:
        return plan, None
    fixes = []
    for other in ("lora", "qlora"):
        if other == method or (other == "qlora" and device_type != "cuda"):  # bitsandbytes' 4-bit trains on GPUs
            continue
        alt = smallest(shape, other, value_bytes, trainable(other), tokens, runtime_mb, device_type)
        if alt.total <= free_mb:
            fixes.append(f"--method {other} ({'a 4-bit base, ' if other == 'qlora' else 'a frozen base, '}"
                         f"about {alt.total / 1024:.1f} GB)")
    fix = ("train it with " + " or ".join(fixes) if fixes else
           "pick a smaller --model, or a machine with more memory" + ("" if device_type == "cuda" else
                                                                      " (or a GPU, where --method qlora fits more)"))
    return plan, refusal(plan, free_mb, what, fix)
