"""Single judgements for KTO: (prompt, completion, label), a completion judged desirable (True) or not, from a
file in TRL's unpaired preference format or from the A/B store that `tunebench serve` writes.

A file has `prompt` (text, or chat messages), `completion` (text, or messages whose last one is the reply) and
`label` (true/false, 1/0). From an A/B store: a vote's chosen answer is desirable and the other undesirable,
both answers of a "both bad" vote are undesirable, and ties say nothing about either and are skipped (counted);
a thumbs up or down on a Chat answer is one judgement, the conversation before the answer its prompt.

Tokenized, example k is one row: its prompt in the run's prompt format, then the completion and EOS, the loss
mask on the completion (as DPO's pairs are rendered). KTO's reference point, the KL between the policy and its
reference, is estimated from mismatched rows: in each micro batch, rows in file order, each prompt followed by
the previous row's completion (TRL's rotation within a per-device batch: (x1, yn), (x2, y1), ...), built at
collate time from the tokenized prompt and completion parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tunebench.core.errors import TunebenchError
from tunebench.data import batching, formats, pairs, readers, votes
from tunebench.data.tokenize import Tokenized
from tunebench.settings.finetune import DataConfig

TRUE, FALSE = ("true", "1", "yes", "good", "desirable"), ("false", "0", "no", "bad", "undesirable")


@dataclass
class JudgedExamples:
    prompts: list[formats.Messages]
    completions: list[str]
    labels: list[bool]
    source: str
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> judgements left out

    def __len__(self) -> int:
        return len(self.prompts)

    def answered(self, k: int) -> formats.Messages:
        """Example k as a prompt/response row (what --eval-generate scores an answer against)."""
        return self.prompts[k] + [{"role": "assistant", "content": self.completions[k]}]

    def describe(self) -> str:
        good = sum(self.labels)
        return pairs.described(f"{len(self)} judged completion(s) ({good} desirable, {len(self) - good} undesirable) "
                               f"from {self.source}", self.skipped)


def _add(out: JudgedExamples, prompt: formats.Messages, completion: str, label: bool) -> None:
    if not any(m["content"].strip() for m in prompt) or not completion.strip():
        pairs.skip(out, "with an empty prompt or completion")
        return
    out.prompts.append(prompt)
    out.completions.append(completion)
    out.labels.append(label)


def label_of(value, source: str, row: int) -> bool:
    """TRL's boolean label, also as 1/0 or the words true/false."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise TunebenchError(f"dataset '{source}' row {row + 1}: label {value!r:.40} is not true or false; give each "
                         "row label true (a desirable completion) or false")


def from_records(records: list[dict], cfg: DataConfig, source: str) -> JudgedExamples:
    if not records:
        raise TunebenchError(f"dataset '{source}' has no rows; point --data at a file with data")
    columns = set(records[0])
    column = pairs.prompt_column(columns, cfg)
    missing = [c for c in (column, "completion", "label") if c not in columns]
    if missing:
        hint = ("; this looks like preference pairs: use --method dpo, or one row per completion for KTO"
                if {"chosen", "rejected"} <= columns else "")
        raise TunebenchError(
            f"dataset '{source}' lacks column(s) {', '.join(map(repr, missing))} for KTO (it has "
            f"{', '.join(sorted(columns))}); give prompt, completion and label (true/false) columns, or --data an "
            f"A/B store (tunebench-ab.sqlite){hint}")
    out = JudgedExamples([], [], [], source)
    for row, record in enumerate(records):
        _add(out, pairs.prompt_of(record.get(column), cfg), pairs.reply(record.get("completion"), "completion", source),
             label_of(record.get("label"), source, row))
    return out


def from_store(path: str) -> JudgedExamples:
    """A vote for A: A's answer desirable, B's undesirable (and the other way round); both bad: both undesirable;
    a tie: skipped. Then each thumbs up (desirable) or down (undesirable) on a Chat answer, its prompt the
    conversation before it."""
    out = JudgedExamples([], [], [], path)
    for prompt, answer_a, answer_b, vote in votes.votes(path, "prompt, answer_a, answer_b, vote"):
        if vote == "tie":
            pairs.skip(out, "ties")
            continue
        asked = [{"role": "user", "content": prompt}]
        _add(out, asked, answer_a, vote == "a")
        _add(out, asked, answer_b, vote == "b")
    for messages, answer, liked in votes.feedback(path):
        _add(out, messages, answer, liked)
    return out


def load(cfg: DataConfig) -> JudgedExamples:
    """Read and check the judgements before a model loads: a file without a usable one is refused, and so is
    one whose completions are all judged alike (KTO learns from both kinds)."""
    if cfg.sources:
        raise TunebenchError("KTO takes one dataset; give --data once (a prompt/completion/label file or an A/B store)")
    path = str(readers.resolve_path(cfg.path))
    judged = from_store(path) if pairs.is_store(path) else from_records(readers.read_records(cfg.path), cfg, cfg.path)
    if not len(judged):
        raise TunebenchError(f"'{cfg.path}' holds no usable judgement ({judged.describe()}); vote in tunebench serve, "
                             "or give prompt/completion/label rows")
    return judged


@dataclass
class JudgedData:
    """Tokenized judgements: example k is row k, its prompt (mask 0) then its completion (mask 1)."""

    tokenized: Tokenized
    labels: np.ndarray  # (examples,) bool, of the rows kept
    dropped: int  # examples whose prompt alone fills max_length
    max_length: int  # a KL row (a prompt with another row's completion) is cut here too
    fmt = "judged completions"

    def __len__(self) -> int:
        return len(self.tokenized)

    def source(self, k: int) -> int:
        return int(self.tokenized.rows[k])

    def lengths(self) -> np.ndarray:
        """(examples,) a row's tokens; its KL row pads to the longest of the micro batch too."""
        return self.tokenized.lengths()

    def tokens(self) -> np.ndarray:
        return self.tokenized.lengths()


def tokenize(judged: JudgedExamples, tokenizer, cfg: DataConfig) -> JudgedData:
    """Each prompt in the run's prompt format, the completion after it (and EOS); a row longer than max_length
    loses its end, and an example whose prompt alone reaches max_length is dropped (counted)."""
    data = pairs.prompt_reply_rows(((p, (c,)) for p, c in zip(judged.prompts, judged.completions)), tokenizer, cfg,
                                   "judged", "example")
    labels = np.asarray(judged.labels, bool)[data.rows]
    return JudgedData(data, labels, data.dropped, cfg.max_length)


def collate(data: JudgedData, rows: list[int], pad_id: int, step_rows: list[int] | None = None, multiple: int = 1,
            cap: int | None = None) -> dict[str, torch.Tensor]:
    """N examples (in file order) as 2N padded rows (to the longest, rounded up to `multiple`, never past `cap`, as
    batching.collate pads): the N examples, then their N mismatched KL rows (prompt i, completion i - 1,
    cyclically, over `step_rows` in file order: the global micro-step's rows when ranks share it, so two ranks' KL
    rows are one process's; default `rows`). Besides the usual tensors, `label` (N,) and `counts` (N,): the units
    this micro batch adds to its optimizer step."""
    rows, ring = sorted(rows), sorted(rows if step_rows is None else step_rows)
    before = {k: ring[i - 1] for i, k in enumerate(ring)}
    t = data.tokenized

    def part(k: int) -> tuple[np.ndarray, np.ndarray]:
        return t.ids[t.offsets[k]:t.offsets[k + 1]], t.mask[t.offsets[k]:t.offsets[k + 1]]

    parts = [part(k) for k in rows]
    mismatched = [(np.concatenate([ids[mask == 0], other[0][other[1] == 1]])[:data.max_length],
                   np.concatenate([mask[mask == 0], other[1][other[1] == 1]])[:data.max_length])
                  for k, (ids, mask) in zip(rows, parts) for other in [part(before[k])]]
    batch = batching.pad_examples(parts + mismatched, pad_id, multiple, cap)
    batch["label"] = torch.as_tensor(data.labels[rows])
    batch["counts"] = torch.tensor([len(rows)])
    return batch
