"""What a training method does to a model before it trains: PEFT's adapters (LoRA, DoRA, IA3, LoHa, LoKr,
prefix and prompt tuning) and the modules they target, bitsandbytes' 4-bit and 8-bit bases for QLoRA, and
Liger's kernels on CUDA. The models themselves (presets, loading) are models.py's."""

from __future__ import annotations

import math
from typing import Any

import torch

from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.machine.metrics import quantized_linear_kinds
from tunebench.model import models
from tunebench.model.kernels import use_fast_dropout
from tunebench.settings.finetune import METHODS

# Attention projections LoRA targets by default where PEFT's own table (by model type) has no entry, per
# naming family, most specific first: Phi-3's fused qkv_proj is one PEFT 0.21 does not list.
_AUTO_TARGETS = (("q_proj", "v_proj"), ("qkv_proj",), ("c_attn",), ("query_key_value",), ("Wqkv",),
                 ("query", "value"))


def base_of(model):
    """The transformers model under a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_prompt_learning(model) -> bool:
    """A PEFT prefix, prompt or p-tuning model: its virtual tokens go in through its own forward and generate's
    input preparation, not through the base model's layers."""
    return bool(getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False))


def load_quantized(loaded: models.Loaded, spec: str, bits: str, compute_dtype: torch.dtype, allow_download: bool):
    """Reload the base through bitsandbytes: nf4 with double quant, or LLM.int8."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise TunebenchError("--quantization needs bitsandbytes; install it with `pip install bitsandbytes`") from e
    if bits == "4bit":
        bnb = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    path = loaded.path or str(models.materialize(spec, loaded.model, loaded.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=compute_dtype, local_files_only=not allow_download
    )
    keep_4bit_trainable(model)
    return model


def prepare_for_kbit(model) -> None:
    """Freeze a quantized base and cast its norms to fp32, keeping the embeddings and the output head in their
    16-bit dtype, as the QLoRA paper's own script and Unsloth do. PEFT's prepare_model_for_kbit_training casts every
    parameter that is not 4-bit to fp32: on Llama-3-8B that is the embedding and the head, 1.05B parameters, 4.2 GB
    where 2.1 GB holds them, more than all the 4-bit layers together (an 8 GB card then cannot fit the smallest
    step). Its other steps (checkpointing, input gradients) tunebench does itself where it turns checkpointing on."""
    for param in model.parameters():
        param.requires_grad = False
    for name, module in model.named_modules():
        if "norm" in name.rsplit(".", 1)[-1].lower():  # a norm's few weights: fp32, as PEFT and the paper keep them
            for param in module.parameters(recurse=False):
                if param.dtype in (torch.float16, torch.bfloat16):
                    param.data = param.data.float()


def keep_4bit_trainable(model) -> None:
    """Stop bitsandbytes repacking 4-bit weights for CPU inference whenever the model is in eval mode.

    On AVX512-BF16 CPUs, Linear4bit converts its weights to an inference-only layout the first
    time it runs in eval mode and never converts back; later training steps then run a kernel
    with no autograd, and no gradient reaches the layers below (bitsandbytes 0.50).
    """
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def linear_module_names(model) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, Conv1D, *quantized_linear_kinds())
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)}
    head = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is model.get_output_embeddings()}
    return sorted(names - head)


def target_modules(model, requested: str) -> tuple[list[str] | str, str]:
    """(modules, reason). `auto` picks the attention projections of the model's family."""
    available = linear_module_names(model)
    if requested == "all-linear":
        return "all-linear", "every linear layer but the output head"
    if requested == "auto":
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        model_type = getattr(getattr(model, "config", None), "model_type", "")
        known = PEFT_DEFAULTS.get(model_type)
        if known and all(name in available for name in known):
            return list(known), f"PEFT's default for {model_type} ({type(model).__name__})"
        for family in _AUTO_TARGETS:
            if all(name in available for name in family):
                return list(family), f"attention projections of this architecture ({type(model).__name__})"
        raise TunebenchError(
            f"no known attention projection in {type(model).__name__}; pass --target-modules with some of: "
            f"{', '.join(available)}"
        )
    wanted = [m.strip() for m in requested.split(",") if m.strip()]
    missing = [m for m in wanted if m not in available]
    if missing:
        raise TunebenchError(
            f"the model has no linear module named {', '.join(repr(m) for m in missing)}; "
            f"--target-modules can name: {', '.join(available)}"
        )
    return wanted, "asked for"


FEEDFORWARD_OUT = ("down_proj", "fc2", "dense_4h_to_h")  # the MLP's output projection, by naming family


def ia3_modules(model, modules: list[str] | str | None) -> tuple[list[str] | str, list[str], str]:
    """IA3's (target modules, the feed-forward ones among them, reason). `modules` None: PEFT's per-model-type
    defaults, else (a type PEFT does not list, such as phi3) the attention projections `auto` picks for LoRA
    and the MLP's output projection, which is IA3's own recipe (keys, values, feed-forward)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as FEEDFORWARD
    from peft.utils import TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as TARGETS

    model_type = getattr(model.config, "model_type", "")
    if modules is not None:
        wanted = modules if isinstance(modules, list) else []
        return modules, [m for m in FEEDFORWARD.get(model_type, FEEDFORWARD_OUT) if m in wanted], "asked for"
    if model_type in TARGETS:
        return list(TARGETS[model_type]), list(FEEDFORWARD[model_type]), (
            "PEFT's IA3 defaults for this architecture (attention keys/values and the feed-forward output)")
    attention, _ = target_modules(model, "auto")
    out = [m for m in FEEDFORWARD_OUT if m in linear_module_names(model)][:1]
    if not out:
        raise TunebenchError(f"IA3 has no default modules for model type '{model_type}'; pass --target-modules "
                             f"with some of: {', '.join(linear_module_names(model))}")
    return [*attention, *out], out, (f"PEFT has no IA3 defaults for {model_type}: its attention projections and "
                                     "feed-forward output, as PEFT's defaults pick for other types")


PROMPT_METHODS = ("prefix", "prompt")  # virtual tokens, not weights: nothing to merge, no packed rows
PEFT_METHODS = tuple(m for m in METHODS if m != "full")  # the one list is settings.finetune.METHODS


def peft_config(a, model, modules: list[str] | str | None):
    """The PEFT config of adapter settings `a` (an AdapterConfig); `modules` from `target_modules`, or
    None for the methods that pick their own (IA3 on `auto`: PEFT's per-architecture defaults)."""
    import peft

    common = {"task_type": "CAUSAL_LM"}
    if a.method in ("lora", "qlora", "dora"):
        return peft.LoraConfig(r=a.r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout, target_modules=modules,
                               use_dora=a.method == "dora", **common)
    if a.method == "loha":
        return peft.LoHaConfig(r=a.r, alpha=a.lora_alpha, target_modules=modules, **common)
    if a.method == "lokr":
        return peft.LoKrConfig(r=a.r, alpha=a.lora_alpha, target_modules=modules, **common)
    if a.method == "ia3":
        targets, feedforward, _ = ia3_modules(model, modules)
        return peft.IA3Config(target_modules=targets, feedforward_modules=feedforward, **common)
    if a.method == "prefix":
        return peft.PrefixTuningConfig(num_virtual_tokens=a.num_virtual_tokens, **common)
    if a.method == "prompt":
        return peft.PromptTuningConfig(num_virtual_tokens=a.num_virtual_tokens, **common)
    raise TunebenchError(f"adapter.method '{a.method}' is not a PEFT method; pick one of {', '.join(PEFT_METHODS)}")


def add_adapter(model, a, modules: list[str] | str | None, tokenizer=None):
    """Wrap `model` in the PEFT method of adapter settings `a`; the base stays frozen."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(a, model, modules))
    if a.method in ("lora", "qlora", "dora"):
        use_fast_dropout(wrapped, within="lora_dropout")
    if a.method == "prompt" and a.prompt_init_text:
        init_prompt_from_text(wrapped, tokenizer, a.prompt_init_text)
    return wrapped


def init_prompt_from_text(model, tokenizer, text: str) -> None:
    """Start prompt tuning's virtual tokens from the embeddings of `text`, repeated to fill them.

    What PEFT's `prompt_tuning_init="TEXT"` does, by hand: PEFT loads the tokenizer again by name from
    disk or the hub, and tunebench's may come from a GGUF file or a preset that neither holds."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise TunebenchError("--prompt-init-text has no tokens; give some words, or leave it out for a random start")
    encoder = model.prompt_encoder[model.active_adapter]
    n = encoder.embedding.weight.shape[0]
    ids = (ids * math.ceil(n / len(ids)))[:n]
    with torch.no_grad():
        words = model.get_input_embeddings()(torch.tensor(ids, device=encoder.embedding.weight.device))
        encoder.embedding.weight.copy_(words.to(encoder.embedding.weight.dtype))


def apply_liger(model, requested: str, device_type: str) -> tuple[str, Any, str]:
    """Swap in Liger's Triton RMSNorm, RoPE and SwiGLU kernels (`--liger`); returns the settings row.

    `auto` uses them on a CUDA GPU when liger-kernel is installed and knows the model type, and says
    why not otherwise; `on` makes each of those an error. Liger's own fused head + loss stays off:
    tunebench runs the head and loss as one chunked function already (`kernels.linear_cross_entropy_sum`).
    """
    if requested == "off":
        return Decision("liger", False, "off, as asked")
    why_not = None
    model_type = getattr(model.config, "model_type", None)
    if device_type != "cuda":
        why_not = "Liger's kernels are Triton kernels for CUDA GPUs"
    else:
        try:
            from liger_kernel.transformers.monkey_patch import (
                MODEL_TYPE_TO_APPLY_LIGER_FN,
                _apply_liger_kernel_to_instance,
            )
        except ImportError:
            why_not = "liger-kernel is not installed (pip install liger-kernel)"
        else:
            if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
                why_not = f"liger-kernel has no kernels for model type '{model_type}'"
    if why_not:
        if requested == "on":
            raise TunebenchError(f"--liger on cannot be honoured: {why_not}; use --liger auto or off")
        return Decision("liger", False, why_not)
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return Decision("liger", True, f"Liger RMSNorm, RoPE and SwiGLU kernels for {model_type}"
                           + (" (asked for)" if requested == "on" else ""))


def compute_adapters_in(model) -> None:
    """Let LoRA layers take the base's low-precision activations as they are (run under autocast).

    PEFT casts every adapter input to the adapter's fp32 dtype: a full-size copy per LoRA layer
    per step, and fp32 results that promote the layer output. Under autocast the adapter matmuls
    run in the compute dtype while the weights (and the optimizer) stay fp32.
    """
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer):  # LoRA and DoRA; other methods' layers keep PEFT's casts
            m.cast_input_dtype_enabled = False
