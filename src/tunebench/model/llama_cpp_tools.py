"""llama.cpp's own tools for what tunebench's GGUF writer does not do: its converter (convert_hf_to_gguf.py)
for the families the writer does not map (Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text, Phi-3), and its
quantizer (llama_model_quantize, through llama-cpp-python) for the K-quants and re-quantizing a converted file.

The converter is not on PyPI by itself: llama-cpp-python's source package carries it under vendor/llama.cpp/
with the gguf-py it is written against, so it is taken from the source package of the llama-cpp-python
installed (pip download, served from pip's cache once llama-cpp-python was built) and kept in the cache.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

from tunebench.core.childenv import SAFE_PATH, child_env
from tunebench.core.durable import atomic_dir
from tunebench.core.errors import TunebenchError
from tunebench.core.paths import cache_dir
from tunebench.machine import hardware

# --quant -> llama.cpp's file type (llama.h's LLAMA_FTYPE_MOSTLY_*) for llama_model_quantize
K_QUANTS = {"q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q5_k_s": "Q5_K_S", "q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S",
            "q3_k_m": "Q3_K_M", "q2_k": "Q2_K"}
LEGACY = {"q8_0": "Q8_0", "q5_1": "Q5_1", "q5_0": "Q5_0", "q4_1": "Q4_1", "q4_0": "Q4_0"}
FLOATS = {"f16": "F16", "bf16": "BF16"}  # from an f32 file, where one export writes several types
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes itself (--outtype)
INSTALL = ("pip install llama-cpp-python sentencepiece (builds llama.cpp from source once, a few minutes; "
           "CMAKE_ARGS=-DGGML_NATIVE=OFF makes a wheel any x86-64 machine runs)")
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise TunebenchError(f"this export needs llama.cpp's tools: {INSTALL}") from None


def check_available(converter_needed: bool) -> None:
    """Refused before any model loads when a part the export needs is missing."""
    _version()
    if converter_needed and importlib.util.find_spec("sentencepiece") is None:
        raise TunebenchError(f"llama.cpp's converter needs sentencepiece: {INSTALL}")


def converter() -> Path:
    """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ of the installed llama-cpp-python's
    llama.cpp (made once)."""
    version = _version()
    dest = cache_dir() / "llama.cpp" / f"converter-{version}"
    if (dest / PARTS[0]).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        done = subprocess.run([sys.executable, *SAFE_PATH, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                               "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", tmp],
                              capture_output=True, text=True, env=child_env())
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise TunebenchError(f"cannot fetch llama-cpp-python {version}'s source package, which carries "
                                 f"llama.cpp's converter ({tail}); check pip's index or cache")
        with tarfile.open(archives[0]) as tar, atomic_dir(dest) as out:
            prefix = f"{archives[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(PARTS) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(out, members=members, filter="data")
    return dest


def convert(hf_dir: Path, out: Path, outtype: str) -> None:
    """convert_hf_to_gguf.py on a merged HF directory, in a child process (its gguf-py, not the installed gguf)."""
    if outtype not in OUTTYPES:
        raise ValueError(outtype)
    tools = converter()
    env = child_env(PYTHONPATH=os.pathsep.join([str(tools / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(tools / PARTS[0]), str(hf_dir), "--outfile", str(out), "--outtype",
                           outtype], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        tail = lines[-1] if lines else "no output"
        if "pre-tokenizer was not recognized" in done.stderr:
            tail += ("; its tokenizer is not one llama.cpp knows (the converter recognises a BPE tokenizer by "
                     "hashing its output): train with the family's own tokenizer")
        elif "tokenizer.model" in tail:  # not the temporary directory's path: what it needs, and what to do
            tail = ("this family's converter reads a SentencePiece tokenizer.model, and the model's tokenizer has "
                    "none: export with --format hf, or fine-tune a base that ships the family's own tokenizer.model")
        raise TunebenchError(f"llama.cpp's converter refused the model: {tail}", exit_code=1)


def quantize(src: Path, dst: Path, quant: str, threads: int | None = None) -> list[str]:
    """llama.cpp's quantizer (llama_model_quantize) from an f16/f32 GGUF to `quant`; returns its warnings (such
    as tensors whose rows are not whole K-quant blocks, quantized with a fallback type)."""
    import llama_cpp

    name = K_QUANTS.get(quant) or LEGACY.get(quant) or FLOATS.get(quant)
    if name is None:
        raise ValueError(quant)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    params.nthread = threads or hardware.cpu_threads()
    said: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level, text, user_data):  # a line per tensor on stderr otherwise; its warnings and errors are kept
        if level >= 3:  # GGML_LOG_LEVEL_WARN
            said.append(text.decode(errors="replace").strip())

    llama_cpp.llama_log_set(keep, ctypes.c_void_p())
    try:
        code = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:  # llama-cpp-python's own logger back (it honours verbose=False)
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if code != 0 or not dst.is_file():
        raise TunebenchError(f"llama.cpp's quantizer failed to write {quant} (code {code}): "
                             f"{said[-1] if said else 'no message'}", exit_code=1)
    return [line for line in said if line]


class Reader:
    """A GGUF file as llama.cpp runs it: `reader(ids).logits` is (1, T, vocab) like a transformers model's, so
    the export's check reads a file written by llama.cpp's own tools with llama.cpp itself (transformers' GGUF
    reader is off by whole logits on Gemma: its norms and soft-capping are not mapped as llama.cpp's are). Its KV
    cache is f32, not llama.cpp's default f16, so the file is judged and not the cache's rounding: with
    the f16 cache the tiny Mistral/Qwen/Phi-3 f32 files read 0.01 logit off, with the f32 one 1e-5."""

    def __init__(self, path: Path, context: int = 512):
        import llama_cpp

        self._llm = llama_cpp.Llama(str(path), n_ctx=context, logits_all=True, verbose=False,
                                    n_threads=hardware.cpu_threads(), type_k=llama_cpp.GGML_TYPE_F32,
                                    type_v=llama_cpp.GGML_TYPE_F32)

    def __call__(self, ids):

        import numpy as np
        import torch

        self._llm.reset()
        tokens = ids[0].tolist()
        self._llm.eval(tokens)
        scores = np.array(self._llm.scores[:len(tokens)], dtype=np.float32)
        return types.SimpleNamespace(logits=torch.from_numpy(scores)[None])

    def close(self) -> None:
        self._llm.close()
