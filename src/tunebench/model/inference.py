"""Models put to use rather than trained: loaded with their adapter, placed on the device and precision a
training run would pick, and the positions they can attend over (a learned position table, or the
rotary context they were trained for), checked before a run or a request goes past them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunebench.core import precision as precision_
from tunebench.core.errors import TunebenchError
from tunebench.machine import hardware
from tunebench.model import methods, models
from tunebench.settings.rundir import RunDir


def trained_on(adapter_dir: str) -> str:
    """The base model an adapter (or a tunebench run directory) was trained on."""
    return RunDir(adapter_dir).base_model()


def load_for_inference(spec: str | None, adapter: str | None, tokenizer: str | None = None,
                       allow_download: bool = False, dtype: torch.dtype | None = None) -> models.Loaded:
    """Base model (or a full fine-tune's output dir) with an optional PEFT adapter on top. `dtype`: the base
    is held in it before the adapter is attached, as training held a frozen base; PEFT keeps the adapter's
    own weights in fp32 (autocast_adapter_dtype), as training did."""
    if adapter is not None and not Path(adapter).is_dir():
        raise TunebenchError(f"--adapter '{adapter}' is not a directory; point it at a training --output-dir")
    if adapter is not None:

        kind = RunDir(adapter).kind()
        if kind in ("model", "pretrain") and spec is None:  # a full fine-tune's run: the model itself
            spec, adapter = adapter, None
        elif kind in ("model", "pretrain"):
            raise TunebenchError(f"--adapter '{adapter}' holds a whole model (a full fine-tune or pretraining), not "
                                 f"an adapter to put on --model {spec}; pass it alone: --adapter {adapter}, or --model")
        elif kind == "none":
            raise TunebenchError(f"--adapter '{adapter}' holds neither an adapter (adapter_config.json) nor a model "
                                 "(config.json); point it at a finished run's --output-dir")
    if spec is None:
        if adapter is None:
            spec = models.SMOLLM2
        else:
            spec = trained_on(adapter)
    loaded = models.resolve(spec, tokenizer or (adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else None),
                            allow_download, dtype or torch.float32)
    if adapter is not None:
        from peft import PeftModel

        loaded.model = PeftModel.from_pretrained(loaded.model, adapter)
        loaded.source += f" + adapter {adapter}"
    loaded.model.eval()
    return loaded


@dataclass
class Placed:
    """A model put to work the way it was trained: on its device, its weights as training held them (a frozen
    base in the compute dtype, adapters in fp32) and every forward under the autocast of its precision.

    Training keeps LoRA's inputs in the compute dtype (methods.compute_adapters_in), so a bf16 base meets fp32
    adapter weights: only autocast makes that one matmul. Whatever generates or scores (eval-generate at the
    end of training, pretraining samples, eval, generate, chat, serve, merge's before/after) goes through
    `running` or `decode` here, and no job opens its own inference path."""

    model: Any
    tokenizer: Any
    device: torch.device
    autocast_dtype: torch.dtype | None  # what training's matmuls ran under; None: no autocast (fp32, QLoRA)
    source: str = ""
    runtime = "PyTorch"  # what answers (model/gguf_runtime.py's GgufPlaced: llama.cpp)

    @contextlib.contextmanager
    def running(self) -> Iterator[Any]:
        """The model in eval mode (its mode is put back after), without gradients, under the run's autocast.
        autocast is per thread: enter this in the thread that calls the model."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), precision_.autocast(self.device, self.autocast_dtype):
                yield self.model
        finally:
            self.model.train(was_training)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, temperature: float | None = None,
               top_p: float = 1.0, top_k: int = 0, each=None, eos: int | None = -1, repeat: int = 1) -> torch.Tensor:
        """(B x repeat, new) tokens after the left-padded prompts `ids`: model/decoding.py's batched loop with the KV
        cache under `running` (greedy when temperature is None), padding after each row's EOS (the tokenizer's,
        unless `eos` names another or None for none); `each` and `repeat` as decoding.decode's."""
        from tunebench.model import decoding

        eos = self.tokenizer.eos_token_id if eos == -1 else eos
        pad = self.pad_id(eos)
        with self.running() as model:
            return decoding.decode(model, ids, mask, max_new_tokens, eos, pad, temperature, top_p, top_k, each,
                                   repeat=repeat)

    def pad_id(self, eos: int | None = -1) -> int:
        """The id decoding pads with: the tokenizer's pad token, else the EOS (the tokenizer's unless `eos` names
        another; else 0)."""
        eos = self.tokenizer.eos_token_id if eos == -1 else eos
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or 0)

    def context_limit(self) -> int | None:
        return context_limit(self.model)

    def reseed(self, seed: int) -> None:
        """The sampling's seed (torch's generator: the decoding loop samples with it)."""
        torch.manual_seed(seed)

    def encode(self, texts: str | list[str], **kwargs):
        """Token ids (and attention mask) of `texts` on the model's device; no special tokens added (the
        prompt format has them)."""
        return self.tokenizer(texts, return_tensors="pt", add_special_tokens=False, **kwargs).to(self.device)


def load(spec: str | None, adapter: str | None, tokenizer: str | None = None, allow_download: bool = False,
         device: str = "auto", precision: str = "auto", plan=None) -> Placed:
    """A model (and adapter) ready to generate or score on the device and in the precision a training run
    would pick here, or those asked for: an impossible request is refused before any weight loads. `plan`:
    a hardware plan already made (eval applies its threads too)."""
    plan = plan or hardware.plan(device, precision, hardware.detect(), "off")
    loaded = load_for_inference(spec, adapter, tokenizer, allow_download, precision_.DTYPES[plan.precision])
    return place(loaded, plan.device, plan.precision)


def placement(device: str = "auto", precision: str = "auto", hw=None) -> tuple[str, str, str]:
    """(device, precision, reason) a model is served on: what a training run would pick on this machine
    (a GPU when present, bf16 where the hardware has it), or what was asked (refused when impossible)."""
    plan = hardware.plan(device, precision, hw or hardware.detect(), "off")
    return plan.device, plan.precision, f"{plan.decision('device').reason}; {plan.decision('precision').reason}"


def place(loaded: models.Loaded, device: str, precision: str) -> Placed:
    """`loaded` on `device`, run as it trained: its weights as load_for_inference holds them (a base, or a
    full fine-tune, in the compute dtype: its matmuls see the weights autocast gave them in training, at half
    the memory; adapters in fp32), LoRA's inputs left in the compute dtype, every call under autocast."""
    loaded.model.to(torch.device(device))
    if precision != "fp32":
        methods.compute_adapters_in(loaded.model)
    return Placed(loaded.model, loaded.tokenizer, torch.device(device), precision_.autocast_dtype(precision),
                  loaded.source)


def context_limit(model) -> int | None:
    """Positions a model can attend over: learned positions (GPT-2's n_positions) or the rotary context
    it was trained for (max_position_embeddings)."""
    return position_limit(model) or getattr(model.config, "max_position_embeddings", None)


LEARNED_POSITIONS = ("gpt2", "gpt_bigcode", "gpt_neo", "opt")  # families with a learned position table (not rotary, ALiBi)


def positions(spec: str, allow_download: bool = False) -> tuple[int | None, str]:
    """(the positions a model learned, what kind), from its config alone; (None, "") where unknown."""
    return _positions(spec, allow_download)


def check_length(spec: str, max_length: int, allow_download: bool = False) -> None:
    """Refuse --max-length beyond the positions a model was trained for, from its config alone (before
    any weights load): a learned position table has no row past it, and rotary positions past it were
    never seen in training (quality falls apart without a RoPE-scaling fine-tune of its own)."""
    limit, kind = _positions(spec, allow_download)
    if limit is not None and max_length > limit:
        raise TunebenchError(f"--max-length {max_length} exceeds the {limit} positions this model learned "
                             f"({kind}); pass --max-length {limit} or less")


def _positions(spec: str, allow_download: bool) -> tuple[int | None, str]:
    if spec == "tiny":
        return models.TINY_POSITIONS, "rotary positions"
    if spec == "gpt2-124m":
        return 1024, "learned positions"  # GPT2Config's n_positions
    config = models.config_of(spec, allow_download)  # a GGUF's once converted: read in ms
    if spec == models.SMOLLM2 or spec.endswith(".gguf"):
        if config is not None:
            return getattr(config, "n_positions", None) or config.max_position_embeddings, "the GGUF's context length"
        try:  # not converted yet: the GGUF's own field
            return (models.gguf_context_length(models.smollm2_gguf() if spec == models.SMOLLM2 else Path(spec)),
                    "the GGUF's context length")
        except (OSError, ValueError, KeyError):
            return None, ""  # the load says what is wrong
    if config is None:
        return None, ""
    if getattr(config, "model_type", "") in LEARNED_POSITIONS:
        return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None), \
            "learned positions"
    return getattr(config, "max_position_embeddings", None), "rotary positions"


def position_limit(model) -> int | None:
    """Tokens a model with learned position embeddings can see (GPT-2's n_positions); None for rotary ones."""
    c = model.config
    if getattr(c, "model_type", "") in LEARNED_POSITIONS:
        return getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
    return None
