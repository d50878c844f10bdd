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

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.data import batching, formats, readers, votes
from tunebench.data.tokenize import Tokenized, segments
from tunebench.settings.finetune import DataConfig

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
        return described(f"{len(self)} preference pair(s) from {self.source}", self.skipped)

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
    out = PairExamples([], [], [], path)
    for prompt, answer_a, answer_b, vote in votes.votes(path, "prompt, answer_a, answer_b, vote"):
        if vote in ("tie", "both_bad"):
            skip(out, "ties" if vote == "tie" else "both-bad votes")
            continue
        chosen, rejected = (answer_a, answer_b) if vote == "a" else (answer_b, answer_a)
        _add(out, [{"role": "user", "content": prompt}], chosen, rejected)
    return out


def skip(out, why: str) -> None:
    """Count one example left out of `out` (pairs, or KTO's judgements) for the reason `why`."""
    out.skipped[why] = out.skipped.get(why, 0) + 1


def described(kept: str, skipped: dict[str, int]) -> str:
    return kept + ("; skipped: " + ", ".join(f"{n} {why}" for why, n in skipped.items()) if skipped else "")


def prompt_column(columns: set[str], cfg: DataConfig) -> str:
    """Where a preference file's prompt is: `prompt`, else a chat `messages` column."""
    return cfg.messages_column if "prompt" not in columns and cfg.messages_column in columns else "prompt"


def prompt_of(value, cfg: DataConfig) -> formats.Messages:
    """A prompt given as text, or as chat messages."""
    if isinstance(value, list):
        return formats.to_messages({cfg.messages_column: value}, "chat", cfg)
    return [{"role": "user", "content": "" if value is None else str(value)}]


def _add(out: PairExamples, prompt: formats.Messages, chosen: str, rejected: str) -> None:
    if not any(m["content"].strip() for m in prompt) or not chosen.strip() or not rejected.strip():
        skip(out, "with an empty prompt or answer")
    elif chosen == rejected:
        skip(out, "with the same answer on both sides")
    else:
        out.prompts.append(prompt)
        out.chosen.append(chosen)
        out.rejected.append(rejected)


def reply(value, column: str, source: str) -> str:
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
    column = prompt_column(columns, cfg)
    missing = [c for c in (column, "chosen", "rejected") if c not in columns]
    if missing:
        raise TunebenchError(
            f"dataset '{source}' lacks column(s) {', '.join(map(repr, missing))} for preference training (it has "
            f"{', '.join(sorted(columns))}); give prompt, chosen and rejected columns, or --data an A/B store "
            "(tunebench-ab.sqlite)")
    out = PairExamples([], [], [], source)
    for record in records:
        _add(out, prompt_of(record.get(column), cfg), reply(record.get("chosen"), "chosen", source),
             reply(record.get("rejected"), "rejected", source))
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
    data = prompt_reply_rows(((p, (c, r)) for p, c, r in zip(pairs.prompts, pairs.chosen, pairs.rejected)),
                             tokenizer, cfg, "pairs", "preference pair")
    return PairData(data, data.dropped)


def prompt_reply_rows(items, tokenizer, cfg: DataConfig, fmt: str, what: str) -> Tokenized:
    """Each (prompt, replies) item as one row per reply: the prompt, rendered once in the run's prompt format
    (loss mask 0), then the reply and EOS (mask 1); a row longer than max_length loses its end (the reply's tail),
    and an item whose prompt alone reaches max_length is dropped (counted in `dropped`), since none of its replies
    would be left. `rows` holds each row's item index."""
    ids, mask, offsets, rows, dropped = [], [], [0], [], 0
    for k, (prompt, replies) in enumerate(items):
        sides = [rendered(prompt, reply, tokenizer, cfg) for reply in replies]
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
        raise TunebenchError(f"no {what} of '{cfg.path}' fits --max-length {cfg.max_length}: every prompt alone "
                             "fills it; raise --max-length or shorten the prompts")
    return Tokenized(np.asarray(ids, np.int32), np.asarray(mask, np.int8), np.asarray(offsets, np.int64), fmt,
                     dropped, np.asarray(rows, np.int64))


def rendered(prompt: formats.Messages, reply: str, tokenizer, cfg: DataConfig) -> tuple[str, str]:
    """(the prompt's text, the reply's text with EOS) as the run's prompt format renders them for SFT."""
    pieces = segments(prompt + [{"role": "assistant", "content": reply}], tokenizer, cfg)
    return "".join(text for text, _ in pieces[:-1]), pieces[-1][0]


def collate(data: PairData, pairs: list[int], pad_id: int, multiple: int = 1,
            cap: int | None = None) -> dict[str, torch.Tensor]:
    """P pairs as 2P padded rows, chosen first (padded as batching.collate pads, to `multiple`). Besides the usual
    tensors:
    - `counts`: (pairs, real target tokens of the chosen rows), the units this micro-batch adds to its
      optimizer step's normalisers (see objective.prepare);
    - `target_index`, `is_response`: the flat next-token positions ORPO reads (every real token of a
      chosen row, for its NLL term, and each reply's tokens) and which of them are reply tokens."""
    rows = [2 * k for k in pairs] + [2 * k + 1 for k in pairs]
    batch = batching.collate(data.tokenized, rows, pad_id, multiple, cap)
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
    records = pairs.records()
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return len(records)
