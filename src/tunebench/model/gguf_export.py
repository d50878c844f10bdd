"""A Hugging Face causal LM (merged, fp32, on the CPU) written as a GGUF file llama.cpp and Ollama load.

The file format, tensor names, metadata keys, vocabulary helpers and quantizers are the `gguf`
package's (llama.cpp's own gguf-py). Written here is only what that package leaves to each converter
(llama.cpp's convert_hf_to_gguf.py does the same per model class): which architectures map onto which
llama.cpp graph, the row order llama.cpp's rotary kernel wants in Q and K, GPT-2's transposed Conv1D
weights, which tensors stay f32, and the pre-tokenizer name that matches the tokenizer trained with.
"""

from __future__ import annotations

import contextlib
import json
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from tunebench.core.errors import TunebenchError

# --quant name -> (tensor type of the 2-D weights, the file type it declares). Every one of these has a
# quantizer in gguf.quants; the k-quants (q4_k_m ...) have none there, only in llama.cpp's C++ tool.
QUANTS = {
    "f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
SUPPORTED = {"llama": "Llama family (SmolLM2, Llama-style `tunebench pretrain` models)",
             "gpt2": "GPT-2 family (gpt2-124m, GPT-2-style `tunebench pretrain` models)"}
NARROW = {getattr(gguf.GGMLQuantizationType, QUANTS[q][0]) for q in ("q5_1", "q5_0", "q4_1", "q4_0")}
GPT2_GELU = ("gelu_new", "gelu_pytorch_tanh")  # llama.cpp's gpt2 graph applies GELU's tanh form


# Families tunebench's writer does not map: llama.cpp's own converter writes them (llama_cpp_tools).
CONVERTED = {"mistral": "Mistral", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3", "gemma2": "Gemma 2",
             "gemma3_text": "Gemma 3 (text)", "phi3": "Phi-3"}


# Of those, the ones whose converter reads a SentencePiece tokenizer.model only: a BPE tokenizer without one stops it
# with "File not found: .../tokenizer.model" (seen with llama-cpp-python's converter; Gemma 3 takes BPE too).
SENTENCEPIECE_ONLY = ("gemma2", "phi3")


OWN_CONFIG = ("gpt2", "qwen3")  # read_back: shapes transformers' GGUF reader does not take from the file


def route(config) -> tuple[str, str]:
    """(who writes the GGUF, why): "tunebench" (this module) for the Llama and GPT-2 shapes it maps, which
    includes `tunebench pretrain` runs whose own trained tokenizer llama.cpp's converter would not recognise,
    else "llama.cpp" (its convert_hf_to_gguf.py) for the families it knows and this module does not."""
    kind = getattr(config, "model_type", "?")
    if kind in ("llama", "gpt2"):
        try:
            check_config(config)
            return "tunebench", f"{kind}: tunebench's writer (exact at f32, any byte-level BPE tokenizer)"
        except TunebenchError as e:
            if kind == "gpt2":
                raise
            return "llama.cpp", f"llama: llama.cpp's converter ({e})"
    if kind in CONVERTED:
        return "llama.cpp", f"{CONVERTED[kind]}: llama.cpp's own converter"
    raise TunebenchError(f"architecture '{kind}' cannot be exported to GGUF yet; supported: {supported_list()}; "
                         f"through llama.cpp's converter: {', '.join(CONVERTED.values())}")


def supported_list() -> str:
    return "; ".join(f"{k}: {v}" for k, v in SUPPORTED.items())


def check_config(config) -> str:
    """The llama.cpp architecture a transformers config maps onto, or a refusal saying why it cannot."""
    kind = getattr(config, "model_type", "?")
    if kind == "llama":
        if getattr(config, "hidden_act", "silu") != "silu":
            raise TunebenchError(f"this Llama-style model uses {config.hidden_act}; llama.cpp's llama graph "
                                 "computes SiLU (SwiGLU) only, so it cannot be exported to GGUF")
        rope = _rope(config)
        if rope.get("rope_type", "default") != "default":
            raise TunebenchError(f"rope scaling '{rope['rope_type']}' is not exported yet; only default rotary "
                                 "positions are")
        if getattr(config, "mlp_bias", False):
            raise TunebenchError("this Llama-style model has MLP biases, which llama.cpp's llama graph does not "
                                 "load; pretrain with model.use_bias: false to export it")
        return "llama"
    if kind == "gpt2":
        if config.activation_function not in GPT2_GELU:
            raise TunebenchError(f"this GPT-2-style model uses activation '{config.activation_function}'; "
                                 "llama.cpp's gpt2 graph computes GELU's tanh form only (model.activation: gelu)")
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise TunebenchError("this GPT-2 model scales attention per layer, which llama.cpp does not")
        return "gpt2"
    raise TunebenchError(f"architecture '{kind}' cannot be exported to GGUF yet; supported: {supported_list()}")


def _rope(config) -> dict:
    # transformers 5 keeps rope_theta and the scaling type in rope_parameters; 4.x had them as attributes
    params = getattr(config, "rope_parameters", None) or {}
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **params}


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the pre-tokenizer (the split before BPE merges) this tokenizer applies, so the
    runtime tokenizes text as training did; refused for tokenizers llama.cpp cannot reproduce."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise TunebenchError(f"the tokenizer is {model.get('type', 'not a fast tokenizer')}; GGUF export writes "
                             "byte-level BPE tokenizers only (tunebench tokenizer train --type bpe)")
    pieces = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in pieces]
    byte_level = pieces[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is None or byte_level.get("add_prefix_space"):
        raise TunebenchError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) is not GPT-2's "
                             "byte-level split; GGUF export writes byte-level BPE tokenizers only")
    if not model.get("merges"):
        raise TunebenchError("the tokenizer has no BPE merges (one token per byte, like the `tiny` preset's), and "
                             "GGUF cannot hold an empty merge list; train one with `tunebench tokenizer train`")
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and pieces[0].get("individual_digits") and byte_level.get("use_regex", True):
        return "smollm"  # GPT-2's split after each digit on its own
    raise TunebenchError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) has no llama.cpp "
                         "equivalent; GGUF export writes GPT-2-style byte-level BPE tokenizers")


# --- prompt formats -------------------------------------------------------------------------------


def instruction_template(fmt: str) -> str:
    """A train --template format string ('...{instruction}...') as a Jinja chat template: each user turn
    in the format, each reply followed by EOS, as training laid them out."""
    prefix, suffix = _split_format(fmt)
    return ("{% for message in messages %}{% if message['role'] == 'user' %}"
            f"{_jinja_text(prefix)}{{{{ message['content'] }}}}{_jinja_text(suffix)}"
            "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}"
            "{% endfor %}")


def _split_format(fmt: str) -> tuple[str, str]:
    fields = [f for _, f, _, _ in string.Formatter().parse(fmt) if f is not None]
    if fields != ["instruction"]:
        raise TunebenchError(f"the run's --template must contain {{instruction}} once and no other field to be "
                             f"exported as a chat template, got {fmt!r}")
    before, after = fmt.format(instruction="\0").split("\0")
    return before, after


def _jinja_text(text: str) -> str:
    # a string literal, not raw text: the format's own braces or {% would otherwise be read as Jinja
    return f"{{{{ {json.dumps(text, ensure_ascii=False)} }}}}" if text else ""


def ollama_template(render, eos: str) -> str:
    """The Modelfile TEMPLATE (a Go template) for a prompt format given as `render(user_text) -> prompt`:
    the text around the user's message, found by rendering a marker, with `.Prompt` in its place. What
    follows `.Response` closes a reply in the history Ollama renders for the next turn, as EOS did in training."""
    marker = "\x00tunebench\x00"
    before, after = render(marker).split(marker)
    go = lambda s: s.replace("{{", '{{ "{{" }}')  # noqa: E731 - Go's own escape for a literal {{
    return f"{go(before)}{{{{ .Prompt }}}}{go(after)}{{{{ .Response }}}}{go(eos)}"


# --- the file -------------------------------------------------------------------------------------


@dataclass
class Written:
    path: Path
    bytes: int
    fallbacks: list[str]  # tensors whose rows do not fit the quant's blocks, written f16 instead


def write(model, tokenizer, path: Path, quant: str, chat_template: str | None, name: str) -> Written:
    """Write `model` (a transformers LlamaForCausalLM or GPT2LMHeadModel) and its tokenizer to `path`."""
    arch = check_config(model.config)
    pre = pre_tokenizer(tokenizer)
    tensor_type, file_type = (getattr(gguf.GGMLQuantizationType, QUANTS[quant][0]),
                              getattr(gguf.LlamaFileType, QUANTS[quant][1]))
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_vocab = model.get_input_embeddings().weight.shape[0]
    if arch == "llama":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_freq_base(float(_rope(c)["rope_theta"]))
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    else:
        w.add_context_length(c.n_positions)
        w.add_embedding_length(c.n_embd)
        w.add_block_count(c.n_layer)
        w.add_feed_forward_length(c.n_inner or 4 * c.n_embd)
        w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_vocab_size(n_vocab)
    _add_vocab(w, tokenizer, n_vocab, pre, chat_template)
    fallbacks = _add_tensors(w, model, arch, tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return Written(path, path.stat().st_size, fallbacks)


def _add_vocab(w, tokenizer, n_vocab: int, pre: str, chat_template: str | None) -> None:


    # The token list as llama.cpp's converter builds it: ids the tokenizer lacks are unused padding rows,
    # special added tokens are control tokens.
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    if max(by_id) >= n_vocab:
        raise TunebenchError(f"the tokenizer has ids up to {max(by_id)} but the model only {n_vocab} embedding "
                             "rows; export the tokenizer the run trained with")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    with tempfile.TemporaryDirectory() as d:  # SpecialVocab reads the merges from a saved tokenizer.json
        tokenizer.save_pretrained(d)
        special = gguf.SpecialVocab(d, load_merges=True, n_vocab=n_vocab)
    special.special_token_ids = {k: v for k, v in {
        "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id}.items() if v is not None}
    # tunebench tokenizes with add_special_tokens=False everywhere: a runtime must not add BOS or EOS either
    special.add_special_token = {"bos": False, "eos": False}
    special.chat_template = chat_template
    special.add_to_gguf(w, quiet=True)


def permute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Q/K rows from Hugging Face's rotary layout (each head's halves rotated together) to the interleaved
    pairs llama.cpp's rope kernel rotates; the inverse of what transformers' GGUF loader undoes."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_tensors(w, model, arch: str, tensor_type) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    c = model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    conv1d = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)}
    tied = getattr(c, "tie_word_embeddings", False)
    fallbacks = []
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp reads the token embedding as the output when there is no output tensor
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise TunebenchError(f"tensor {hf_name} has no GGUF name in llama.cpp's {arch} map; "
                                 "this model has layers llama.cpp's graph does not compute")
        data = t.detach().to(torch.float32).cpu().numpy()
        if hf_name in conv1d:
            data = data.T  # Conv1D stores (in, out); a GGUF matrix is (out, in) like nn.Linear
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_rotary(data, c.num_attention_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_rotary(data, c.num_key_value_heads)
        data = np.ascontiguousarray(data)
        # Norms, biases and GPT-2's position table stay f32, as llama.cpp's converter keeps them: they are
        # small, and llama.cpp adds them in f32.
        kind = gguf.GGMLQuantizationType.F32 if data.ndim < 2 or name == "position_embd.weight" else tensor_type
        if kind in NARROW and name in ("token_embd.weight", "output.weight"):
            # the output projection (the embedding, when tied) decides every next token; llama-quantize keeps
            # it at 6 bits for its 4- and 5-bit types, and the nearest gguf.quants has is 8
            kind = gguf.GGMLQuantizationType.Q8_0
        try:
            packed = gguf.quants.quantize(data, kind)
        except gguf.QuantError:  # rows not a whole number of the quant's blocks
            kind = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, kind)
            fallbacks.append(name)
        w.add_tensor(name, packed, raw_dtype=kind)
    return fallbacks


def read_back(path: Path, config=None):
    """The file as an independent reader sees it: transformers' GGUF loader (its own tensor map, its own
    un-permute and dequantisers), fp32 on the CPU. `config` is the model's own where transformers maps a shape
    from GGUF metadata wrongly: no gpt2 context or feed-forward length, no Qwen3 head size (llama.cpp reads
    them: the tests running the file in llama.cpp check the metadata)."""
    from transformers import AutoModelForCausalLM

    extra = {"config": config} if config is not None and config.model_type in OWN_CONFIG else {}
    with parsed_once(path):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    **extra).eval()


@contextlib.contextmanager
def parsed_once(path: Path):
    """A GGUF parsed once while transformers loads it. Its loader parses the whole file (every vocabulary entry)
    for the config, again for the tokenizer and again for the weights: 17 s a parse for Gemma 3's 262,144 tokens on
    2 cores, 68 of its conversion's 100 s. The loader imports `gguf.GGUFReader` when it runs, so one read-only
    reader of this file is handed to every caller inside; another file, or a loader that imports it otherwise,
    parses as before."""
    made, parsed = gguf.GGUFReader, {}

    def reader(asked, *args, **kwargs):
        if Path(asked).resolve() != path.resolve() or args or kwargs:
            return made(asked, *args, **kwargs)
        if "reader" not in parsed:
            parsed["reader"] = made(asked)
        return parsed["reader"]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = made
