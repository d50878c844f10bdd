"""An exported GGUF file answering through llama.cpp (llama-cpp-python), behind the same calls as a PyTorch model
placed by inference.Placed (encode, decode, context_limit, reseed), so `serve`'s chat, A/B and OpenAI-compatible
API run what a deployment runs. The prompt is the run's: its tokenizer's ids in its prompt format, as the export's
own check and `eval --gguf` feed llama.cpp (the file's embedded tokenizer and template are those, checked at
export)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunebench.core.errors import TunebenchError
from tunebench.machine import hardware
from tunebench.model import llama_cpp_tools
from tunebench.settings.rundir import RunDir

MAX_CONTEXT = 8192  # llama.cpp's KV cache is allocated whole at load: the trained context, up to this


def run_of(path: Path) -> Path:
    """The training run an export sits in (RUN/export/FILE.gguf, or a directory below export/): its tokenizer and
    prompt format are the file's."""
    for parent in list(path.resolve().parents)[:4]:
        run = RunDir(parent)
        if run.config_file.is_file():
            return parent
    raise TunebenchError(f"--gguf {path} is not inside the run it was exported from (RUN_DIR/export/...); serve "
                         "reads that run's tokenizer and prompt format: export without -o, or move the file back")


def check(path: str) -> Path:
    """Refused before anything loads: not a .gguf file, not under its run, or llama.cpp missing."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".gguf":
        raise TunebenchError(f"--gguf {path} is not a .gguf file; pass a file `tunebench export` wrote")
    run_of(p)
    llama_cpp_tools.check_available(converter_needed=False)
    return p


@dataclass
class GgufPlaced:
    """A GGUF loaded in llama.cpp, on the CPU's cores (llama-cpp-python's CPU build)."""
    model: Any  # the llama_cpp.Llama
    tokenizer: Any
    source: str
    context: int  # positions it answers over: its trained context, up to MAX_CONTEXT
    device: torch.device = torch.device("cpu")
    runtime: str = "llama.cpp"

    @classmethod
    def load(cls, path: str) -> GgufPlaced:
        """An export served: its run's tokenizer, its trained context (up to MAX_CONTEXT)."""
        from tunebench.model import models

        p = check(path)
        return cls.open(p, models.load_tokenizer(str(run_of(p))),
                        min(models.gguf_context_length(p) or MAX_CONTEXT, MAX_CONTEXT))

    @classmethod
    def open(cls, path: Path, tokenizer, context: int) -> GgufPlaced:
        """The file in llama.cpp, prompted with `tokenizer`'s ids, over `context` positions."""
        import llama_cpp

        llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=hardware.cpu_threads(), verbose=False)
        return cls(llm, tokenizer, f"{path} (llama.cpp)", context)

    def close(self) -> None:
        self.model.close()

    def encode(self, texts: str, **kwargs):
        return self.tokenizer(texts, return_tensors="pt", add_special_tokens=False, **kwargs)

    def context_limit(self) -> int:
        return self.context

    def reseed(self, seed: int) -> None:
        self.model.set_seed(seed)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, temperature: float | None = None,
               top_p: float = 1.0, top_k: int = 0, each=None, eos: int | None = -1) -> torch.Tensor:
        """(1, new) tokens after the one prompt `ids` (its end-of-generation token last, when it came), greedy when
        temperature is None, else llama.cpp's sampler at that temperature and top-p; `each` sees each token as it
        comes and stops the generation by returning True."""
        if ids.shape[0] != 1:
            raise ValueError("llama.cpp decodes one prompt at a time here")
        prompt = ids[0][mask[0].bool()].tolist()
        eos = self.model.token_eos() if eos == -1 else eos
        sampling = ({"temp": 0.0, "top_k": 1, "top_p": 1.0} if temperature is None else
                    {"temp": float(temperature), "top_p": float(top_p), "top_k": int(top_k)})
        new: list[int] = []
        self.model.reset()
        for token in self.model.generate(prompt, repeat_penalty=1.0, **sampling):
            new.append(token)
            if (each is not None and each(torch.tensor([token]))) or token == eos or len(new) >= max_new_tokens:
                break
        return torch.tensor([new], dtype=torch.long)
