"""`tunebench eval`: token-weighted loss and perplexity of a model (with an optional adapter) on a dataset."""

from __future__ import annotations

import torch

from tunebench import models
from tunebench.config import DataConfig
from tunebench.data import batching
from tunebench.data.tokenize import load_tokenized, split
from tunebench.errors import TunebenchError
from tunebench.loop import evaluate


def run(model: str | None, adapter: str | None, data: DataConfig, batch_size: int = 8, seed: int = 42,
        allow_download: bool = False) -> dict[str, float]:
    loaded = models.load_for_inference(model, adapter, None, allow_download)
    tokenized = load_tokenized(data, loaded.tokenizer, models.cache_dir())
    idx, _ = split(len(tokenized), 0.0, seed, data.max_samples)
    if len(idx) == 0:
        raise TunebenchError(f"dataset '{data.path}' has no rows to evaluate")
    batches = batching.eval_batches(tokenized, idx, batch_size, loaded.tokenizer.pad_token_id)
    result = evaluate(loaded.model, batches, torch.device("cpu"), None)
    return {"model": loaded.source, "rows": len(idx), **result}
