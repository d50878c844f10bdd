"""Pretraining data: a corpus tokenized once into a memory-mapped token file, cut into blocks.

Documents are concatenated with EOS between them and cut into blocks of `max_length` tokens
(the last partial block is dropped). The token file is cached by (files, tokenizer), so a
resumed or repeated run re-tokenizes nothing, and it is read through np.memmap, so a corpus
larger than RAM works. Tokenization runs in the Rust tokenizer's own threads, a batch of pieces
at a time, written straight to disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tunebench.core.durable import fsync_path, umask_mode
from tunebench.core.errors import TunebenchError
from tunebench.data import text

FORMAT_VERSION = 1
BATCH_CHARS = 8_000_000  # text handed to the tokenizer per call


@dataclass(frozen=True)
class Blocks:
    """Blocks of `length` tokens: block i is tokens[starts[i] : starts[i] + length]."""

    tokens: np.ndarray  # (N_tokens,) uint16 or uint32, memory-mapped
    starts: np.ndarray  # (N_blocks,) int64
    length: int

    def __len__(self) -> int:
        return len(self.starts)

    def collate(self, indices, step_indices=None) -> dict[str, torch.Tensor]:
        """(B, length) input_ids, labels (the same ids: the loss shifts them) and an all-real mask."""
        ids = torch.from_numpy(np.stack([self.tokens[self.starts[i]: self.starts[i] + self.length]
                                         for i in indices]).astype(np.int64))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def subset(self, idx: np.ndarray) -> Blocks:
        return Blocks(self.tokens, self.starts[idx], self.length)

    def batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """Every block once, in order, collated `size` at a time (the last batch may be short)."""
        return [self.collate(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]


def tokenizer_hash(tokenizer) -> str:
    vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{vocab}|{tokenizer.eos_token}|{type(tokenizer).__name__}".encode()).hexdigest()[:16]


def token_file(specs: list[str], tokenizer, cache_root: Path, text_column: str = "text",
               dataset_config: str | None = None, threads: int | None = None) -> np.ndarray:
    """The corpus as one memory-mapped array of token ids (EOS after each document), cached."""
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    key = text.fingerprint(specs, tokenizer_hash(tokenizer), text_column, dataset_config, FORMAT_VERSION)
    path = cache_root / "tokens" / f"{key}.{np.dtype(dtype).name}"
    if not path.exists():
        _tokenize_to(path, specs, tokenizer, text_column, dataset_config, dtype, threads)
    if path.stat().st_size == 0:
        raise TunebenchError(f"no text in {', '.join(specs)}; check data.train_file and data.text_column")
    return np.memmap(path, dtype=dtype, mode="r")


def _tokenize_to(path: Path, specs, tokenizer, column, dataset_config, dtype, threads) -> None:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TunebenchError("the tokenizer has no EOS token to separate documents; use one with an eos_token")
    rust = tokenizer.backend_tokenizer
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer's thread pool starts
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # the CLI turns it off for forked workers; here it is ours
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            batch: list[tuple[str, bool]] = []
            size = 0

            def flush():
                encoded = rust.encode_batch([t for t, _ in batch], add_special_tokens=False)
                ids: list[int] = []
                for enc, (_, ends) in zip(encoded, batch):
                    ids += enc.ids
                    if ends:
                        ids.append(eos)
                out.write(np.asarray(ids, dtype=dtype).tobytes())

            for spec in specs:
                for piece, ends in text.pieces(spec, column, dataset_config):
                    batch.append((piece, ends))
                    size += len(piece)
                    if size >= BATCH_CHARS:
                        flush()
                        batch, size = [], 0
            if batch:
                flush()
        os.chmod(tmp, umask_mode())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def cut(tokens: np.ndarray, length: int) -> Blocks:
    n = len(tokens) // length
    return Blocks(tokens, np.arange(n, dtype=np.int64) * length, length)


def split(blocks: Blocks, fraction: float, seed: int, mode: str) -> tuple[Blocks, Blocks]:
    """(train, validation) blocks: a seeded random share (`random`) or the corpus's last share (`tail`)."""
    n = len(blocks)
    n_val = max(1, round(n * fraction)) if fraction > 0 and n >= 2 else 0
    if mode == "tail":
        order = np.arange(n)
    else:
        order = np.random.default_rng(seed).permutation(n)
    val, train = np.sort(order[n - n_val:]), np.sort(order[: n - n_val])
    if len(train) == 0:
        raise TunebenchError(f"the corpus makes {n} block(s) of {blocks.length} tokens: too few to train on; add "
                             "text or lower data.max_length")
    return blocks.subset(train), blocks.subset(val)
