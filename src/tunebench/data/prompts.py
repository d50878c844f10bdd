"""Prompts for GRPO: each row's prompt (a `prompt` column, text or chat messages; GSM8K's `question`; or
the instruction columns of an instruction or alpaca file) and the row's other columns, which the reward
functions read (the reference answer, say). Tokenized in the run's prompt format, as `generate` and `serve`
render a prompt for the model (tokenize.render_prompt)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tunebench.core.errors import TunebenchError
from tunebench.data import formats, pairs, readers
from tunebench.data.tokenize import render_prompt
from tunebench.settings.finetune import DataConfig

PROMPT_COLUMNS = ("prompt", "question")  # TRL's prompt-only format; GSM8K's


@dataclass
class PromptRows:
    prompts: list[formats.Messages]
    columns: list[dict[str, Any]]  # each row's other columns
    source: str

    def __len__(self) -> int:
        return len(self.prompts)

    def column_names(self) -> set[str]:
        return set(self.columns[0]) if self.columns else set()


def load(cfg: DataConfig) -> PromptRows:
    """Read the prompts before a model loads; a file with none is refused."""
    if cfg.sources:
        raise TunebenchError("GRPO takes one dataset; give --data once (a file of prompts)")
    records = readers.read_records(cfg.path)
    if not records:
        raise TunebenchError(f"dataset '{cfg.path}' has no rows; point --data at a file of prompts")
    names = set(records[0])
    column = next((c for c in PROMPT_COLUMNS if c in names), None)
    if column is None and cfg.instruction_column not in names and cfg.messages_column not in names:
        raise TunebenchError(f"dataset '{cfg.path}' has no prompt column (it has {', '.join(sorted(names))}); give a "
                             "'prompt' (text or chat messages) or 'question' column, or instruction/input columns")
    out = PromptRows([], [], cfg.path)
    for record in records:
        if column is not None:  # text, or chat messages (pairs.prompt_of reads a preference file's prompt alike)
            messages = pairs.prompt_of(record.get(column), cfg)
        elif cfg.instruction_column in names:  # instruction/alpaca rows: the instruction and input
            extra = str(record.get(cfg.input_column) or "").strip()
            messages = [{"role": "user", "content": str(record.get(cfg.instruction_column) or "")
                         + (f"\n\n{extra}" if extra else "")}]
        else:
            messages = formats.to_messages({cfg.messages_column: record.get(cfg.messages_column)}, "chat", cfg)
        while messages and messages[-1]["role"] == "assistant":  # a reply given with the prompt: not asked
            messages.pop()
        if not any(m["content"].strip() for m in messages):
            continue
        out.prompts.append(messages)
        out.columns.append({k: v for k, v in record.items() if k != column})  # the reference columns and the rest
    if not out.prompts:
        raise TunebenchError(f"dataset '{cfg.path}' holds no non-empty prompt; give rows with a prompt")
    return out


@dataclass
class PromptData:
    """Tokenized prompts: prompt k is ids[k]; rows, the PromptRows index of each one kept."""

    ids: list[list[int]]
    rows: np.ndarray
    dropped: int  # prompts that leave no room for a completion within max_length
    fmt = "prompts"

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.asarray([len(i) for i in self.ids], dtype=np.int64)

    def tokens(self) -> np.ndarray:
        return self.lengths()

    def source(self, k: int) -> int:
        return int(self.rows[k])


def tokenize(rows: PromptRows, tokenizer, cfg: DataConfig, max_completion_length: int) -> PromptData:
    """Each prompt rendered as generation sees it; one whose tokens and a full completion would pass
    max_length is dropped (counted), since its completions would be cut."""
    ids, kept, dropped = [], [], 0
    for k, messages in enumerate(rows.prompts):
        prompt = tokenizer(render_prompt(messages, tokenizer, cfg.template), add_special_tokens=False)["input_ids"]
        if len(prompt) + max_completion_length > cfg.max_length:
            dropped += 1
            continue
        ids.append(prompt)
        kept.append(k)
    if not ids:
        raise TunebenchError(f"no prompt of '{cfg.path}' leaves room for --max-completion-length "
                             f"{max_completion_length} within --max-length {cfg.max_length}; raise --max-length")
    return PromptData(ids, np.asarray(kept, np.int64), dropped)
