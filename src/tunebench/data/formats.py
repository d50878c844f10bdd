"""Dataset formats: detect which one records are in and turn each record into chat messages.

Every format becomes a list of {"role", "content"} messages (plain text becomes one message
with role "text"), so tokenization has one path. Chat rows keep what a chat template renders beyond that: an
assistant turn's tool_calls and reasoning_content, a tool turn's tool_call_id and name, and the row's tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.data import readers
from tunebench.settings.finetune import DataConfig

Messages = list[dict[str, Any]]
# ShareGPT's and LLaMA-Factory's names; a function_call turn is the assistant calling a tool, an observation its result
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
                 "function_call": "assistant", "observation": "tool", "function": "tool", "ipython": "tool"}


class Conversation(list):
    """A chat row's messages and the tools (OpenAI's {"type": "function", "function": {...}}) it offers the model;
    a plain list where a row offers none."""

    def __init__(self, messages, tools: list[dict] | None = None):
        super().__init__(messages)
        self.tools = tools or None


def tools_of(messages: Messages) -> list[dict] | None:
    return getattr(messages, "tools", None)


def carries_tools(messages: Messages) -> bool:
    """A row with tools, tool calls, tool results or reasoning: what a plain chat template may not render."""
    return bool(tools_of(messages)) or any(m.get("tool_calls") or m.get("reasoning_content") or m["role"] == "tool"
                                           for m in messages)


def detect(columns: set[str], cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    if set(XLAM_COLUMNS) <= columns:
        return "xlam"
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
        f"'{cfg.messages_column}' (chat), query+tools+answers (xLAM) or '{cfg.text_column}'; name yours with --instruction-column/"
        "--response-column or data.*_column overrides, and --format"
    )


def required_columns(fmt: str, cfg: DataConfig) -> tuple[str, ...]:
    return {
        "instruction": (cfg.instruction_column, cfg.response_column),
        "alpaca": ("instruction", "output"),
        "question": ("question", "answer"),
        "chat": (),  # messages or conversations, checked per record
        "xlam": XLAM_COLUMNS,
        "text": (cfg.text_column,),
    }[fmt]


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def to_messages(record: dict[str, Any], fmt: str, cfg: DataConfig) -> Messages:
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
    if fmt == "xlam":
        return xlam(record)
    turns = record.get(cfg.messages_column, record.get("conversations"))
    if not isinstance(turns, list):
        raise TunebenchError(f"chat record has no '{cfg.messages_column}' list of messages; fix the record or --format")
    out = []
    for n, t in enumerate(turns, 1):
        if not isinstance(t, dict):
            raise TunebenchError(f"chat record's '{cfg.messages_column}' holds {type(t).__name__} {str(t)[:40]!r} "
                                 "where a message ({role, content}) belongs; fix the record")
        out.append(message(t, n))
    return Conversation(out, row_tools(record.get("tools", record.get("functions"))))


def _json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise TunebenchError(f"{what} is not JSON ({e.msg} at character {e.pos}): {value[:60]!r}; fix it") from None


def _call(call: Any, where: str) -> dict[str, Any]:
    """One tool call as chat templates take it: {"type": "function", "function": {"name", "arguments": object}}
    (OpenAI's, whose arguments are a JSON string, or the bare {"name", "arguments"} of ShareGPT and Hermes)."""
    call = _json(call, f"{where}'s tool call")
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise TunebenchError(f"{where} has a tool call without a function name: {str(call)[:80]!r}; "
                             'write it as {"name": ..., "arguments": {...}}')
    args = _json(fn.get("arguments", fn.get("parameters", {})), f"{where}'s arguments to {fn['name']}")
    if not isinstance(args, dict):
        raise TunebenchError(f"{where} calls {fn['name']} with arguments {str(args)[:60]!r}, not an object of named "
                             "arguments; fix the row")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call, dict) and call.get("id"):
        out["id"] = str(call["id"])
    return out


def message(t: dict[str, Any], n: int) -> dict[str, Any]:
    """One turn in the common form: role and content, and what it carries of tool calls, results and reasoning."""
    where = f"message {n}"
    given = str(t.get("role", t.get("from", "")))
    role = _ROLE_ALIASES.get(given, given)
    content = t.get("content", t.get("value"))
    m: dict[str, Any] = {"role": role, "content": _text(content)}
    calls = t.get("tool_calls") or ([t["function_call"]] if t.get("function_call") else [])
    if given == "function_call":  # ShareGPT: the turn's value is the call itself
        calls, m["content"] = [content], ""
    if calls:
        if role != "assistant":
            raise TunebenchError(f"{where} ({role}) carries tool calls, which only an assistant turn makes; fix the row")
        m["tool_calls"] = [_call(c, where) for c in (calls if isinstance(calls, list) else [calls])]
    reasoning = next((t[k] for k in REASONING_FIELDS if t.get(k)), None)
    if reasoning is not None:
        if role != "assistant":
            raise TunebenchError(f"{where} ({role}) carries reasoning, which only an assistant turn has; fix the row")
        m["reasoning_content"] = _text(reasoning).strip()
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if t.get(key):
                m[key] = str(t[key])
    return m


def row_tools(value: Any) -> list[dict] | None:
    """A row's tools in OpenAI's form; a bare function schema ({"name", "parameters"}) is wrapped as one."""
    value = _json(value, "the row's tools")
    if value in (None, "", []):
        return None
    if not isinstance(value, list):
        raise TunebenchError(f"the row's tools are {type(value).__name__}, not a list of function schemas; fix the row")
    out = []
    for tool in value:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise TunebenchError(f"the row's tools hold {str(tool)[:80]!r}, not a function schema with a name; "
                                 "fix the row")
        out.append({"type": "function", "function": fn})
    return out


# Salesforce's xlam-function-calling-60k (and the sets made like it): a query, the tools offered and the calls that
# answer it, the last two as JSON strings.
XLAM_COLUMNS = ("query", "tools", "answers")
# xLAM writes a parameter's type as Python does ("str", "List[int]", "float, optional"); JSON Schema's names for them.
_XLAM_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
               "dict": "object", "tuple": "array", "set": "array", "any": None}


def xlam(record: dict[str, Any]) -> Conversation:
    """An xLAM row as chat: the query a user turn, the answers one assistant turn of tool calls, the tools in
    OpenAI's form with their parameters as a JSON Schema object (what chat templates and the tool-call scoring
    read), so a row reads as the same row written in OpenAI's form does."""
    answers = _json(record["answers"], "the row's answers")
    if not isinstance(answers, list):
        raise TunebenchError(f"the row's answers are {type(answers).__name__}, not a list of calls "
                             '([{"name": ..., "arguments": {...}}]); fix the row')
    tools = _json(record["tools"], "the row's tools")
    if not isinstance(tools, list):
        raise TunebenchError(f"the row's tools are {type(tools).__name__}, not a list of function schemas; fix the row")
    calls = [_call(c, "the answers") for c in answers]
    assistant = {"role": "assistant", "content": ""}
    if calls:
        assistant["tool_calls"] = calls
    return Conversation([{"role": "user", "content": _text(record["query"])}, assistant],
                        row_tools([xlam_tool(t) for t in tools]))


def xlam_tool(tool: Any) -> Any:
    """One xLAM tool with its {name: {type, description, default}} parameters as a JSON Schema object; a tool
    already in that form is kept as it is."""
    if not isinstance(tool, dict) or not isinstance(tool.get("parameters"), dict) \
            or tool["parameters"].get("type") == "object":
        return tool
    properties, required = {}, []
    for name, spec in tool["parameters"].items():
        spec = spec if isinstance(spec, dict) else {"description": _text(spec)}
        written = _text(spec.get("type")).strip()
        optional = written.endswith(", optional")
        base = written.removesuffix(", optional").strip().split("[")[0].lower()
        prop = {k: v for k, v in spec.items() if k not in ("type",)}
        if _XLAM_TYPES.get(base):
            prop = {"type": _XLAM_TYPES[base], **prop}
        properties[name] = prop
        if not optional and "default" not in spec:
            required.append(name)
    return {**tool, "parameters": {"type": "object", "properties": properties,
                                   **({"required": required} if required else {})}}


REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # the names distillation data uses


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
    replies = [m for m in messages if m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls"))]
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
