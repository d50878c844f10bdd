"""`tunebench bench-data`: how fast the input pipeline alone runs (tokenize, cache load, batches/s)."""

from __future__ import annotations

import time

import numpy as np

from tunebench.data import batching
from tunebench.data.tokenize import load_tokenized
from tunebench.model import models
from tunebench.settings.finetune import DataConfig


def run(model: str | None, data: DataConfig, micro_batch_size: int, seconds: float = 2.0) -> dict[str, float]:
    tok = models.tokenizer_for(model or models.SMOLLM2)
    t0 = time.perf_counter()
    tokenized = load_tokenized(data, tok, None)  # no cache: the full read + format + tokenize
    tokenize_s = time.perf_counter() - t0
    cache = models.cache_dir()
    load_tokenized(data, tok, cache)  # make sure the cache holds it
    t0 = time.perf_counter()
    load_tokenized(data, tok, cache)
    cached_s = time.perf_counter() - t0
    order = batching.epoch_order(np.arange(len(tokenized)), micro_batch_size, 0, 0)
    batches = tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in order:
            tokens += int(batching.collate(tokenized, b, tok.pad_token_id)["attention_mask"].sum())
            batches += 1
    elapsed = time.perf_counter() - t0
    result = {
        "rows": len(tokenized), "tokenize_s": round(tokenize_s, 3), "cached_load_s": round(cached_s, 4),
        "batches_per_s": round(batches / elapsed, 1), "tokens_per_s": round(tokens / elapsed),
        "ms_per_batch": round(1000 * elapsed / batches, 3),
    }
    print(f"{data.path}: {result['rows']} rows")
    print(f"  read + format + tokenize   {result['tokenize_s']:.2f} s (once; then cached)")
    print(f"  load from the cache        {result['cached_load_s'] * 1000:.1f} ms")
    print(f"  collate micro batch {micro_batch_size:<6} {result['batches_per_s']:,.0f} batches/s "
          f"({result['ms_per_batch']:.3f} ms each, {result['tokens_per_s']:,} tokens/s)")
    return result
