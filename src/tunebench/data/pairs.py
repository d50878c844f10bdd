"""Preference pairs for DPO and ORPO: (prompt, chosen reply, rejected reply), from a file or from the
A/B store that `tunebench serve` writes.

A file has `prompt` (text, or chat messages), `chosen` and `rejected` (text, or messages whose last one
is the reply), the format TRL and most preference sets use; a chat-style `messages` column may hold the
prompt instead. In an A/B store, a vote for A or B is one pair; ties and "both bad" say nothing about
which answer is better and are skipped, and counted.

Tokenized, pair k is two examples of one Tokenized: 2k the prompt + chosen reply, 2k + 1 the same
prompt + rejected reply, with the loss mask on each reply (as SFT renders it: the prompt format, the
reply, EOS). A micro-batch of P pairs is 2P rows, chosen first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tunebench.settings.finetune import DataConfig
from tunebench.data import batching, formats, readers
from tunebench.data.tokenize import Tokenized, segments
from tunebench.core.errors import TunebenchError

STORE_SUFFIXES = (".sqlite", ".sqlite3", ".db")


@dataclass
class PairExamples:
    prompts: list[formats.Messages]
    chosen: list[str]
    rejected: list[str]
    source: str
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> pairs left out

    def __len__(self) -> int:
        return len(self.prompts)

    def answered(self, k: int) -> formats.Messages:
        """Pair k as a prompt/response row: its prompt and the chosen reply (what --eval-generate scores
        an answer against)."""
        return self.prompts[k] + [{"role": "assistant", "content": self.chosen[k]}]

    def describe(self) -> str:
        kept = f"{len(self)} preference pair(s) from {self.source}"
        if not self.skipped:
            return kept
        return kept + "; skipped: " + ", ".join(f"{n} {why}" for why, n in self.skipped.items())

    def records(self) -> list[dict]:
        """The pairs as TRL's preference format (what `ab-report --export-pairs` writes)."""
        return [{"prompt": p[0]["content"] if len(p) == 1 and p[0]["role"] == "user" else p, "chosen": c,
                 "rejected": r} for p, c, r in zip(self.prompts, self.chosen, self.rejected)]


def is_store(path: str) -> bool:
    p = Path(path)
    if p.suffix.lower() in STORE_SUFFIXES:
        return True
    try:
        with p.open("rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def from_store(path: str) -> PairExamples:
    """A vote for A makes (A's answer chosen, B's rejected), a vote for B the other way round."""
    from tunebench.data import votes

    out = PairExamples([], [], [], path)
    for prompt, answer_a, answer_b, vote in votes.votes(path, "prompt, answer_a, answer_b, vote"):
        if vote in ("tie", "both_bad"):
            _skip(out, "ties" if vote == "tie" else "both-bad votes")
            continue
        chosen, rejected = (answer_a, answer_b) if vote == "a" else (answer_b, answer_a)
        _add(out, [{"role": "user", "content": prompt}], chosen, rejected)
    return out


def _skip(out: PairExamples, why: str) -> None:
    out.skipped[why] = out.skipped.get(why, 0) + 1


def _add(out: PairExamples, prompt: formats.Messages, chosen: str, rejected: str) -> None:
    if not any(m["content"].strip() for m in prompt) or not chosen.strip() or not rejected.strip():
        _skip(out, "with an empty prompt or answer")
    elif chosen == rejected:
        _skip(out, "with the same answer on both sides")
    else:
        out.prompts.append(prompt)
        out.chosen.append(chosen)
        out.rejected.append(rejected)


def _reply(value, column: str, source: str) -> str:
    """A reply given as text, or as chat messages (TRL's conversational format): the last message's text."""
    if isinstance(value, list):
        if not value or not isinstance(value[-1], dict):
            raise TunebenchError(f"dataset '{source}': a '{column}' list must hold chat messages; fix the record")
        value = value[-1].get("content", value[-1].get("value"))
    return "" if value is None else str(value)


def from_records(records: list[dict], cfg: DataConfig, source: str) -> PairExamples:
    if not records:
        raise TunebenchError(f"dataset '{source}' has no rows; point --data at a file with data")
    columns = set(records[0])
    prompt_column = cfg.messages_column if "prompt" not in columns and cfg.messages_column in columns else "prompt"
    missing = [c for c in (prompt_column, "chosen", "rejected") if c not in columns]
    if missing:
        raise TunebenchError(
            f"dataset '{source}' lacks column(s) {', '.join(map(repr, missing))} for preference training (it has "
            f"{', '.join(sorted(columns))}); give prompt, chosen and rejected columns, or --data an A/B store "
            "(tunebench-ab.sqlite)")
    out = PairExamples([], [], [], source)
    for record in records:
        prompt = record.get(prompt_column)
        if isinstance(prompt, list):
            messages = formats.to_messages({cfg.messages_column: prompt}, "chat", cfg)
        else:
            messages = [{"role": "user", "content": "" if prompt is None else str(prompt)}]
        _add(out, messages, _reply(record.get("chosen"), "chosen", source),
             _reply(record.get("rejected"), "rejected", source))
    return out


def load(cfg: DataConfig) -> PairExamples:
    """Read and check the pairs before a model loads; a file without a usable pair is refused."""
    if cfg.sources:
        raise TunebenchError("preference training takes one dataset; give --data once (a pairs file or an A/B store)")
    path = str(readers.resolve_path(cfg.path))
    pairs = from_store(path) if is_store(path) else from_records(readers.read_records(cfg.path), cfg, cfg.path)
    if not len(pairs):
        raise TunebenchError(f"'{cfg.path}' holds no usable preference pair ({pairs.describe()}); vote A or B in "
                             "tunebench serve, or give prompt/chosen/rejected rows")
    return pairs


@dataclass
class PairData:
    """Tokenized pairs: example 2k is pair k's prompt + chosen reply, 2k + 1 its prompt + rejected reply."""

    tokenized: Tokenized
    dropped: int  # pairs whose prompt alone fills max_length: no reply token would be left
    fmt = "preference pairs"

    def __len__(self) -> int:
        return len(self.tokenized) // 2

    def source(self, pair: int) -> int:
        """The index in the PairExamples of tokenized pair `pair` (pairs that did not fit are dropped)."""
        return int(self.tokenized.rows[2 * pair])

    def lengths(self) -> np.ndarray:
        """(pairs,) the longer row of each pair: what its micro-batch pads to."""
        both = self.tokenized.lengths().reshape(-1, 2)
        return both.max(1)

    def tokens(self) -> np.ndarray:
        """(pairs,) real tokens of each pair's two rows."""
        return self.tokenized.lengths().reshape(-1, 2).sum(1)


def tokenize(pairs: PairExamples, tokenizer, cfg: DataConfig) -> PairData:
    """Each pair's prompt is rendered once, in the run's prompt format, and shared by both rows; rows
    longer than max_length lose their end (the reply's tail), and a pair whose prompt alone reaches
    max_length is dropped (counted), since none of its reply would be left to compare."""
    ids, mask, offsets, rows, dropped = [], [], [0], [], 0
    for k, (prompt, chosen, rejected) in enumerate(zip(pairs.prompts, pairs.chosen, pairs.rejected)):
        sides = []
        for reply in (chosen, rejected):
            pieces = segments(prompt + [{"role": "assistant", "content": reply}], tokenizer, cfg)
            sides.append(("".join(text for text, _ in pieces[:-1]), pieces[-1][0]))
        prompt_ids = tokenizer(sides[0][0], add_special_tokens=False)["input_ids"]
        if len(prompt_ids) >= cfg.max_length:
            dropped += 1
            continue
        for _, reply_text in sides:
            reply_ids = tokenizer(reply_text, add_special_tokens=False)["input_ids"]
            row = (prompt_ids + reply_ids)[: cfg.max_length]
            ids += row
            mask += ([0] * len(prompt_ids) + [1] * len(reply_ids))[: cfg.max_length]
            offsets.append(offsets[-1] + len(row))
            rows.append(k)
    if not rows:
        raise TunebenchError(f"no preference pair of '{cfg.path}' fits --max-length {cfg.max_length}: every prompt "
                             "alone fills it; raise --max-length or shorten the prompts")
    data = Tokenized(np.asarray(ids, np.int32), np.asarray(mask, np.int8), np.asarray(offsets, np.int64), "pairs",
                     dropped, np.asarray(rows, np.int64))
    return PairData(data, dropped)


def collate(data: PairData, pairs: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """P pairs as 2P padded rows, chosen first. Besides the usual tensors:
    - `counts`: (pairs, real target tokens of the chosen rows), the units this micro-batch adds to its
      optimizer step's normalisers (see loop.prepare);
    - `target_index`, `is_response`: the flat next-token positions ORPO reads (every real token of a
      chosen row, for its NLL term, and each reply's tokens) and which of them are reply tokens."""
    rows = [2 * k for k in pairs] + [2 * k + 1 for k in pairs]
    batch = batching.collate(data.tokenized, rows, pad_id)
    real = batch["attention_mask"][:, 1:].bool()
    response = batch["labels"][:, 1:] != batching.IGNORE
    wanted = response.clone()
    wanted[: len(pairs)] = real[: len(pairs)]
    target_index = torch.nonzero(wanted.reshape(-1)).squeeze(1)
    batch["target_index"] = target_index
    batch["is_response"] = response.reshape(-1).index_select(0, target_index)
    batch["counts"] = torch.tensor([len(pairs), int(real[: len(pairs)].sum())])
    return batch


def export(pairs: PairExamples, path: str | Path) -> int:
    """Write the pairs as JSON lines (prompt, chosen, rejected) for other tools; returns how many."""
    from tunebench.core.durable import atomic_file

    records = pairs.records()
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return len(records)
