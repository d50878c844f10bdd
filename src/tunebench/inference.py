"""Models put to use rather than trained: loaded with their adapter, placed on the device and precision a
training run would pick, and the positions they can attend over (a learned position table, or the
rotary context they were trained for), checked before a run or a request goes past them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tunebench import models
from tunebench.errors import TunebenchError


def base_of(adapter_dir: str) -> str:
    """The base model an adapter (or a tunebench run directory) was trained on."""
    import yaml

    d = Path(adapter_dir)
    if (d / "config.yaml").is_file():
        return yaml.safe_load((d / "config.yaml").read_text())["model"]["name"]
    if (d / "adapter_config.json").is_file():
        return json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"]
    raise TunebenchError(f"'{adapter_dir}' holds no adapter_config.json; point --adapter at a tunebench output dir")


def load_for_inference(spec: str | None, adapter: str | None, tokenizer: str | None = None,
                       allow_download: bool = False) -> models.Loaded:
    """Base model (or a full fine-tune's output dir) with an optional PEFT adapter on top."""
    if adapter is not None and not Path(adapter).is_dir():
        raise TunebenchError(f"--adapter '{adapter}' is not a directory; point it at a training --output-dir")
    if spec is None:
        if adapter is None:
            spec = models.SMOLLM2
        else:
            spec = base_of(adapter)
    loaded = models.resolve(spec, tokenizer or (adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else None),
                     allow_download)
    if adapter is not None:
        from peft import PeftModel

        loaded.model = PeftModel.from_pretrained(loaded.model, adapter)
        loaded.source += f" + adapter {adapter}"
    loaded.model.eval()
    return loaded


INFERENCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def placement(device: str = "auto", precision: str = "auto", hw=None) -> tuple[str, str, str]:
    """(device, precision, reason) a model is served on: what a training run would pick on this machine
    (a GPU when present, bf16 where the hardware has it), or what was asked (refused when impossible)."""
    from tunebench import hardware

    plan = hardware.plan(device, precision, hw or hardware.detect(), "off")
    return plan.device, plan.precision, f"{plan.decision('device').reason}; {plan.decision('precision').reason}"


def place(loaded: models.Loaded, device: str, precision: str) -> torch.device:
    """Put a loaded model on `device` in `precision` (what `placement` resolved); returns the device its
    inputs go to."""
    loaded.model.to(torch.device(device), dtype=INFERENCE_DTYPES[precision])
    return torch.device(device)


def context_limit(model) -> int | None:
    """Positions a model can attend over: learned positions (GPT-2's n_positions) or the rotary context
    it was trained for (max_position_embeddings)."""
    return position_limit(model) or getattr(model.config, "max_position_embeddings", None)


LEARNED_POSITIONS = ("gpt2", "gpt_bigcode", "gpt_neo", "opt")  # families with a learned position table (not rotary, ALiBi)


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
    try:
        if spec == models.SMOLLM2 or spec.endswith(".gguf"):
            converted = models.converted_dir(spec) / "config.json"
            if converted.is_file():  # read in ms; parsing the GGUF's whole vocabulary takes seconds
                config = json.loads(converted.read_text())
                return config.get("n_positions") or config.get("max_position_embeddings"), "the GGUF's context length"
            from gguf import GGUFReader

            reader = GGUFReader(str(models._smollm2_gguf() if spec == models.SMOLLM2 else spec))
            arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
            field_ = reader.fields.get(f"{arch}.context_length")
            return (int(field_.parts[-1][0]) if field_ else None), "the GGUF's context length"
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec, local_files_only=not allow_download)
    except (OSError, ValueError, KeyError):
        return None, ""  # the load says what is wrong
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
