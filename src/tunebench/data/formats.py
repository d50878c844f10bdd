"""Dataset formats: detect which one records are in and turn each record into chat messages.

Every format becomes a list of {"role", "content"} messages (plain text becomes one message
with role "text"), so tokenization has one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.data import readers
from tunebench.settings.finetune import DataConfig

Messages = list[dict[str, str]]
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


def detect(columns: set[str], cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.messages_column in columns or "conversations" in columns:
        return "chat"
    if cfg.instruction_column in columns and cfg.response_column in columns:
        return "instruction"
    if "instruction" in columns and "output" in columns:
        return "alpaca"
    if "question" in columns and "answer" in columns:
        return "question"  # GSM8K, and most QA sets
    if cfg.text_column in columns:
        return "text"
    raise TunebenchError(
        f"cannot tell the dataset format from its columns ({', '.join(sorted(columns)) or 'none'}); "
        f"expected '{cfg.instruction_column}'+'{cfg.response_column}', instruction+input+output (alpaca), "
        f"'{cfg.messages_column}' (chat) or '{cfg.text_column}'; name yours with --instruction-column/"
        "--response-column or data.*_column overrides, and --format"
    )


def required_columns(fmt: str, cfg: DataConfig) -> tuple[str, ...]:
    return {
        "instruction": (cfg.instruction_column, cfg.response_column),
        "alpaca": ("instruction", "output"),
        "question": ("question", "answer"),
        "chat": (),  # messages or conversations, checked per record
        "text": (cfg.text_column,),
    }[fmt]


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def to_messages(record: dict[str, Any], fmt: str, cfg: DataConfig) -> Messages:
    check_renderable(record)
    if fmt == "instruction":
        return [
            {"role": "user", "content": _text(record[cfg.instruction_column])},
            {"role": "assistant", "content": _text(record[cfg.response_column])},
        ]
    if fmt == "alpaca":
        prompt = _text(record["instruction"])
        extra = _text(record.get("input"))
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record["output"])}]
    if fmt == "question":
        return [{"role": "user", "content": _text(record["question"])},
                {"role": "assistant", "content": _text(record["answer"])}]
    if fmt == "text":
        return [{"role": "text", "content": _text(record[cfg.text_column])}]
    turns = record.get(cfg.messages_column, record.get("conversations"))
    if not isinstance(turns, list):
        raise TunebenchError(f"chat record has no '{cfg.messages_column}' list of messages; fix the record or --format")
    out = []
    for n, t in enumerate(turns, 1):
        if not isinstance(t, dict):
            raise TunebenchError(f"chat record's '{cfg.messages_column}' holds {type(t).__name__} {str(t)[:40]!r} "
                                 "where a message ({role, content}) belongs; fix the record")
        role = _ROLE_ALIASES.get(str(t.get("role", t.get("from", ""))), str(t.get("role", t.get("from", ""))))
        check_renderable(t, n, role)
        out.append({"role": role, "content": _text(t.get("content", t.get("value")))})
    return out


# What chat data carries beyond role and content, which rows become here without: tool definitions, tool calls
# and their results (OpenAI's fine-tuning format, ShareGPT's function_call/observation turns) and reasoning traces.
# Trained without them, a tool-call turn would become an empty reply and a distilled answer would lose its trace,
# so such a row is refused, never trained half-rendered.
TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
TOOL_ROLES = ("tool", "function", "observation", "ipython", "function_call")
ROW_TOOL_FIELDS = ("tools", "functions")
UNRENDERED = ("tunebench does not render tool calls or reasoning into the training text yet, and would train this "
              "row without them; leave such rows out, or write what the model should produce into each turn's "
              "'content'")


def check_renderable(part: dict[str, Any], turn: int | None = None, role: str | None = None) -> None:
    """Refuse a record (turn None) or a message whose tool or reasoning fields training would drop."""
    where = "the row" if turn is None else f"message {turn}"
    fields = ROW_TOOL_FIELDS if turn is None else (*TOOL_FIELDS, *REASONING_FIELDS)
    found = [f for f in fields if part.get(f) not in (None, "", [], {})]
    if role in TOOL_ROLES:
        found.insert(0, f"role '{role}'")
    if found:
        raise TunebenchError(f"{where} carries {', '.join(found)}: {UNRENDERED}")


def records_to_messages(records: list[dict[str, Any]], cfg: DataConfig, source: str) -> tuple[str, list[Messages]]:
    if not records:
        raise TunebenchError(f"dataset '{source}' has no rows; point --data at a file with data")
    columns = set(records[0])
    fmt = detect(columns, cfg)
    missing = [c for c in required_columns(fmt, cfg) if c not in columns]
    if missing:
        raise TunebenchError(
            f"dataset '{source}' ({fmt} format) lacks column(s) {', '.join(repr(m) for m in missing)}; it has "
            f"{', '.join(sorted(columns))}: name yours with --instruction-column / --response-column"
        )
    out = []
    for i, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise TunebenchError(f"dataset '{source}' row {i} is {type(record).__name__}, not a record of columns; "
                                 "fix that row")
        try:
            out.append(to_messages(record, fmt, cfg))
        except KeyError as e:  # the first row's columns were checked; a later row may lack one
            raise TunebenchError(f"dataset '{source}' row {i} lacks column {e.args[0]!r}, which the rows before it "
                                 "have; fix that row") from None
        except TunebenchError as e:
            raise TunebenchError(f"dataset '{source}' row {i}: {e}") from None
    return fmt, out


def is_empty(messages: Messages) -> bool:
    """Nothing to learn from: no assistant reply with text, or (for prompt/response data) no prompt."""
    if messages and messages[0]["role"] == "text":
        return not messages[0]["content"].strip()
    replies = [m for m in messages if m["role"] == "assistant" and m["content"].strip()]
    prompts = [m for m in messages if m["role"] != "assistant" and m["content"].strip()]
    return not replies or not prompts


@dataclass
class Examples:
    fmt: str
    messages: list[Messages]  # the usable rows, in file order
    empty_rows: list[int]  # 1-based numbers of the rows dropped for an empty prompt or response

    def describe_dropped(self) -> str:
        shown = ", ".join(map(str, self.empty_rows[:5])) + (", ..." if len(self.empty_rows) > 5 else "")
        total = len(self.messages) + len(self.empty_rows)
        return f"{len(self.empty_rows)} of {total} rows dropped: empty prompt or response (row {shown})"


def load_examples(cfg: DataConfig) -> Examples:
    """Read, check and format a dataset: the part of data loading that needs no tokenizer, so that bad
    data is refused before a model is loaded. Rows with nothing to learn from are dropped and counted."""
    fmt, messages = records_to_messages(readers.read_records(cfg.path), cfg, cfg.path)
    flags = [is_empty(m) for m in messages]
    empty = [i for i, flag in enumerate(flags, 1) if flag]
    kept = [m for m, flag in zip(messages, flags) if not flag]
    if not kept:
        raise TunebenchError(f"dataset '{cfg.path}' has no usable rows: all {len(messages)} have an empty prompt "
                             "or response; fill them in or point --data at another file")
    return Examples(fmt, kept, empty)
