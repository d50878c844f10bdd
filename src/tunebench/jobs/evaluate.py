"""`tunebench eval`: token-weighted loss and perplexity of a model (with an optional adapter) on a dataset,
on the device and in the precision a training run would pick (or those asked for)."""

from __future__ import annotations

import torch

from tunebench import hardware, inference, models, runner
from tunebench.config import DataConfig
from tunebench.data import batching, formats
from tunebench.data.tokenize import load_tokenized, split
from tunebench.errors import TunebenchError
from tunebench.loop import DTYPES, CausalLMLoss, evaluate


def run(model: str | None, adapter: str | None, data: DataConfig, batch_size: int = 8, seed: int = 42,
        allow_download: bool = False, device: str = "auto", precision: str = "auto") -> dict:
    examples = formats.load_examples(data)  # bad data is refused before the model loads
    plan = hardware.plan(device, precision, hardware.detect(), "off")
    runner.apply_plan(plan)
    loaded = inference.load_for_inference(model, adapter, None, allow_download)
    tokenized = load_tokenized(data, loaded.tokenizer, models.cache_dir(), examples)
    idx, _ = split(len(tokenized), 0.0, seed, data.max_samples)
    if len(idx) == 0:
        raise TunebenchError(f"dataset '{data.path}' has no rows to evaluate")
    batches = batching.eval_batches(tokenized, idx, batch_size, loaded.tokenizer.pad_token_id)
    on = torch.device(plan.device)
    loaded.model.to(on)
    autocast = None if plan.precision == "fp32" else DTYPES[plan.precision]
    result = evaluate(CausalLMLoss(loaded.model, autocast), batches, on)
    return {"model": loaded.source, "rows": len(idx), "device": plan.device, "precision": plan.precision, **result}
