"""`tunebench prepare`: the study's prepare_custom_dataset.py. A local file, or a dataset already in the
Hugging Face cache, becomes seeded train and held-out JSONL files, with a summary a user reads before
training: rows kept and dropped (and why), tokens per row with the model's tokenizer, and how many rows
`--max-length` would cut."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.data import formats, readers
from tunebench.data.tokenize import marked, tokenize_messages, use_template
from tunebench.model import models
from tunebench.settings.finetune import DataConfig, load_config

PERCENTILES = (50, 90, 99)


def records_of(data: str | None, dataset_name: str | None, split: str = "train") -> tuple[list[dict], str]:
    """(records, where they came from): a local file, or a dataset in the HF cache (never downloaded)."""
    if (data is None) == (dataset_name is None):
        raise TunebenchError("give the data once: --data FILE, or --dataset_name NAME (a dataset in the Hugging "
                             "Face cache)")
    if data is not None:
        return readers.read_records(data), data

    import datasets

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the cache only: nothing reaches the hub
    try:
        ds = datasets.load_dataset(dataset_name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types for "not cached"
        raise TunebenchError(f"dataset '{dataset_name}' (split {split}) is not in the Hugging Face cache "
                             f"({type(e).__name__}); download it once where there is a network, or pass --data FILE") \
            from None
    return [dict(r) for r in ds], f"{dataset_name} ({split}, from the HF cache)"


def prepare(output_dir: str, data: str | None = None, dataset_name: str | None = None, max_samples: int | None = None,
            eval_fraction: float = 0.1, seed: int = 42, model: str | None = None, max_length: int = 128,
            split: str = "train", options: dict[str, Any] | None = None) -> dict[str, Any]:
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise TunebenchError(f"--output_dir '{out}' is not empty; prepare never overwrites, pick a new directory")
    if not 0 <= eval_fraction < 1:
        raise TunebenchError(f"--eval-fraction must be at least 0 and below 1, got {eval_fraction}")
    if max_samples is not None and max_samples < 1:
        raise TunebenchError(f"--max_samples must be 1 or more, got {max_samples}")
    cfg: DataConfig = load_config(options={**(options or {}), "data.max_length": max_length}).data
    records, source = records_of(data, dataset_name, split)
    fmt, messages = formats.records_to_messages(records, cfg, source)

    # Rows with nothing to learn from, and exact repeats of an earlier row, are dropped and counted.
    dropped: dict[str, int] = {"empty prompt or response": 0, "duplicate of an earlier row": 0}
    seen, kept = set(), []
    for i, m in enumerate(messages):
        key = json.dumps([m, formats.tools_of(m)], sort_keys=True)
        if formats.is_empty(m):
            dropped["empty prompt or response"] += 1
        elif key in seen:
            dropped["duplicate of an earlier row"] += 1
        else:
            seen.add(key)
            kept.append(i)
    if not kept:
        raise TunebenchError(f"'{source}' has no usable rows: {', '.join(f'{v} {k}' for k, v in dropped.items() if v)}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(kept))
    if max_samples is not None:
        order = order[:max_samples]
    n_eval = int(round(len(order) * eval_fraction)) if eval_fraction > 0 else 0
    held, train = sorted(kept[j] for j in order[:n_eval]), sorted(kept[j] for j in order[n_eval:])

    # Tokens per row as training would see them (prompt format, EOS), before --max-length cuts them.
    tokenizer = models.tokenizer_for(model or models.SMOLLM2)
    whole = dataclasses.replace(cfg, max_length=10**9)
    template = use_template([messages[i] for i in kept], tokenizer, cfg)
    lengths = tokenize_messages([messages[i] for i in train + held], tokenizer, whole, fmt).lengths()
    over = int((lengths > max_length).sum())

    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held)):
        with atomic_file(out / name) as tmp:
            tmp.write_text("".join(json.dumps(records[i], ensure_ascii=False, default=str) + "\n" for i in rows),
                           encoding="utf-8")
    summary = {
        "source": source, "format": fmt, "rows": len(records), "kept": len(kept), "dropped": dropped,
        "max_samples": max_samples, "train_rows": len(train), "eval_rows": len(held), "seed": seed,
        "tokenizer": model or models.SMOLLM2,
        "tokens_per_row": {f"p{p}": int(np.percentile(lengths, p)) for p in PERCENTILES} | {"max": int(lengths.max()),
                                                                                           "mean": round(float(lengths.mean()), 1)},
        "max_length": max_length, "rows_over_max_length": over,
        "files": {"train": str(out / "train.jsonl"), "eval": str(out / "eval.jsonl")},
    }
    write_json(out / "summary.json", summary)
    why = ", ".join(f"{v} {k}" for k, v in dropped.items() if v) or "none"
    t = summary["tokens_per_row"]
    print(f"{source}: {len(records)} rows ({fmt} format); kept {len(kept)}, dropped {len(records) - len(kept)} ({why})")
    print(f"wrote {len(train)} train rows to {out / 'train.jsonl'} and {len(held)} held-out rows to {out / 'eval.jsonl'}"
          f" (seed {seed}{f', {max_samples} sampled' if max_samples else ''})")
    print(f"tokens per row ({summary['tokenizer']}'s tokenizer, prompt format included): median {t['p50']}, "
          f"p90 {t['p90']}, p99 {t['p99']}, max {t['max']}; {over} of {len(lengths)} rows exceed --max-length "
          f"{max_length} and would be cut" + ("" if not over else f" (raise it to {t['p99']} to keep 99%)"))
    if template:
        print(f"chat template: {template}")
    tool_row = next((messages[i] for i in train + held if formats.carries_tools(messages[i])), None)
    if tool_row is not None:  # what the tool calls and reasoning become, as the model sees them
        print("a row with tool calls or reasoning as the model sees it, the loss on [[these parts]]:\n"
              + marked(tool_row, tokenizer, whole))
    print(f"train on it: tunebench train --data {out / 'train.jsonl'} --max-length {max_length}")
    return summary
