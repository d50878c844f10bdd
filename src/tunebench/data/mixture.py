"""Several datasets in one run (multi-task training): each is read, format-detected, tokenized and split
on its own; training draws rows from them in proportion to their weights (seeded); each keeps its own
held-out rows, so eval loss (and task scores) can be reported per dataset as well as overall."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tunebench.data import formats
from tunebench.data.tokenize import Tokenized, load_tokenized, split
from tunebench.settings.finetune import DataConfig


@dataclass
class Part:
    name: str  # the dataset's file name: its metrics are eval_loss/<name>
    weight: float  # normalised: the weights of a run's parts sum to 1
    config: DataConfig  # the run's data section with this dataset as its path
    examples: formats.Examples


def parts(d: DataConfig) -> list[Part]:
    """The run's datasets (one, without data.sources), each read and checked before a model loads."""
    sources = d.sources or ((d.path, 1.0),)
    total = sum(w for _, w in sources)
    names = _names([p for p, _ in sources])
    out = []
    for (path, weight), name in zip(sources, names):
        config = dataclasses.replace(d, path=path, sources=())
        out.append(Part(name, weight / total, config, formats.load_examples(config)))
    return out


def _names(paths: list[str]) -> list[str]:
    stems = [re.sub(r"[^\w.-]+", "_", Path(p).stem) or "data" for p in paths]
    return [s if stems.count(s) == 1 else f"{s}_{i + 1}" for i, s in enumerate(stems)]


def tokenize(parts_: list[Part], tokenizer, cache_root) -> tuple[Tokenized, list[np.ndarray], list]:
    """One Tokenized holding every part's examples back to back, each part's example indices in it, and
    all parts' messages (Tokenized.rows indexes these)."""
    pieces = [load_tokenized(p.config, tokenizer, cache_root, p.examples) for p in parts_]
    ids, mask, offsets, rows, spans, messages = [], [], [np.zeros(1, np.int64)], [], [], []
    start = 0
    for part, t in zip(parts_, pieces):
        ids.append(t.ids)
        mask.append(t.mask)
        offsets.append(t.offsets[1:] + offsets[-1][-1])
        rows.append(t.rows + len(messages))
        spans.append(np.arange(start, start + len(t)))
        start += len(t)
        messages += part.examples.messages
    fmt = pieces[0].fmt if len({t.fmt for t in pieces}) == 1 else "mixed"
    data = Tokenized(np.concatenate(ids), np.concatenate(mask), np.concatenate(offsets), fmt,
                     sum(t.dropped for t in pieces), np.concatenate(rows))
    return data, spans, messages


def splits(spans: list[np.ndarray], d: DataConfig, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each part's (train, eval) example indices: its own seeded split, as a single dataset would have."""
    train, held = [], []
    for span in spans:
        t, e = split(len(span), d.eval_fraction, seed, d.max_samples, d.eval_samples)
        train.append(span[t])
        held.append(span[e])
    return train, held


def mixture(train: list[np.ndarray], weights: list[float], seed: int) -> np.ndarray:
    """The rows an epoch trains on: as many as all parts hold together, each part's share set by its
    weight (a part smaller than its share repeats its rows, a larger one contributes a seeded subset).
    batching.epoch_steps shuffles them, so every stretch of batches follows the weights."""
    total = sum(len(t) for t in train)
    rng = np.random.default_rng(seed)
    counts = _shares(total, weights)
    chosen = []
    for rows, n in zip(train, counts):
        reps = -(-n // max(len(rows), 1))
        chosen.append(np.concatenate([rng.permutation(rows) for _ in range(reps)])[:n] if n else rows[:0])
    return np.sort(np.concatenate(chosen))


def _shares(total: int, weights: list[float]) -> list[int]:
    """Whole row counts summing to `total`, as close to the weights as whole numbers allow (largest remainder)."""
    exact = [total * w for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[:total - sum(counts)]:
        counts[i] += 1
    return counts
