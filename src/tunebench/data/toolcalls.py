"""Tool calls and reasoning in chat rows: the template that renders them where a model's own has no place for
them, the check that a row's text holds everything it carries, and reading a model's calls back from its text.

The template is the Hermes form Qwen2.5 and its fine-tunes use (ChatML turns; the tools as JSON inside <tools>
in the system turn; each call as {"name", "arguments"} JSON inside <tool_call>; results inside <tool_response>
in a user turn), with reasoning as <think>...</think> ahead of an assistant turn's text, as Qwen3 and DeepSeek-R1
write it. Its instruction line is shorter than Qwen2.5's (about 25 tokens, not 70): every training row carries it,
and the small models trained here learn the form from the rows, not from the words. transformers renders it
(apply_chat_template(..., tools=)); a run saves it with its tokenizer, so generate and serve use it and a GGUF
export carries it as tokenizer.chat_template, and an Ollama export as OLLAMA_TEMPLATE, the same form in Go.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.data.formats import carries_tools, tools_of

NAME = "hermes-tools"  # how a run's settings name this template
# Written for this project in the Hermes form (Qwen2.5's template is the reference): every piece an expression
# with explicit newlines, so transformers' trim_blocks/lstrip_blocks change nothing.
TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- messages[0].content + '\\n\\n' -}}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{{- '# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nTo call one: <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning_content -%}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' + "
    "(call.function.arguments if call.function.arguments is string else call.function.arguments | tojson)"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# The same form as an Ollama Modelfile TEMPLATE (Go's text/template over Ollama's .System, .Messages and .Tools,
# as Ollama's own qwen2.5 template reads them). Written by hand: there is no Jinja-to-Go converter. One thing
# differs from TEMPLATE, and cannot be helped: Ollama hands a template the tools and the calls' arguments as Go
# values, so its JSON is compact ({"city":"Oslo"}) where transformers' tojson writes {"city": "Oslo"}; the words
# and markers around it are the same, which tests/test_export.py checks by rendering both.
OLLAMA_TEMPLATE = (
    '{{- if .Tools }}<|im_start|>system\n{{ if .System }}{{ .System }}\n\n{{ end }}# Tools\n<tools>'
    '{{- range .Tools }}\n{{ json . }}{{- end }}'
    '\n</tools>\nTo call one: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    '\n</tool_call><|im_end|>\n{{ end }}'
    '{{- $prev := "" }}'
    '{{- range $i, $m := .Messages }}'
    '{{- if and (eq $prev "tool") (ne .Role "tool") }}<|im_end|>\n{{ end }}'
    '{{- if eq .Role "tool" }}'
    '{{- if ne $prev "tool" }}<|im_start|>user{{ end }}\n<tool_response>\n{{ .Content }}\n</tool_response>'
    '{{- else if eq .Role "assistant" }}<|im_start|>assistant\n'
    '{{ if .Thinking }}<think>\n{{ .Thinking }}\n</think>\n\n{{ end }}{{ .Content }}'
    '{{- range $j, $c := .ToolCalls }}{{ if or $m.Content $j }}\n{{ end }}<tool_call>\n'
    '{"name": {{ json .Function.Name }}, "arguments": {{ json .Function.Arguments }}}\n</tool_call>{{- end }}'
    '{{- if ne (len (slice $.Messages $i)) 1 }}<|im_end|>\n{{ end }}'  # the last reply stays open: Ollama continues it
    '{{- else if and (eq .Role "system") $.Tools }}'  # already written above the tools
    '{{- else }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
    '{{- $prev = .Role }}'
    '{{- end }}'
    '{{- if eq $prev "tool" }}<|im_end|>\n{{ end }}'
    '{{- if ne $prev "assistant" }}<|im_start|>assistant\n{{ end }}'
)

def missing(messages: list[dict[str, Any]], tools: list[dict] | None, text: str) -> list[str]:
    """What a row carries that its rendered `text` lacks: each tool's name, each call's name and argument
    values, each tool result and each reasoning trace (empty: the row is rendered whole)."""
    lost = [f"tool {t['function']['name']}" for t in tools or [] if t["function"]["name"] not in text]
    for n, m in enumerate(messages, 1):
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            values = [json.dumps(v, ensure_ascii=False) for v in fn["arguments"].values()]
            if fn["name"] not in text or any(v not in text and v.strip('"') not in text for v in values):
                lost.append(f"message {n}'s call to {fn['name']}")
        if m["role"] == "tool" and m["content"].strip() not in text:
            lost.append(f"message {n}'s tool result")
        if m.get("reasoning_content") and m["reasoning_content"] not in text:
            lost.append(f"message {n}'s reasoning")
    return lost


def render(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer, **kw) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, **kw)


def renders_whole(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer) -> bool:
    """Whether the tokenizer's own chat template renders everything `messages` and `tools` carry."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        return not missing(messages, tools, render(messages, tools, tokenizer))
    except Exception:  # noqa: BLE001 - a template that raises on tool turns has no place for them either
        return False


def serving_template(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer) -> str | None:
    """The chat template a served model answers a request with tools in: its own where that renders the request
    whole, else TEMPLATE (the tokenizer itself is shared by every request and is left as it is)."""
    return tokenizer.chat_template if renders_whole(messages, tools, tokenizer) else TEMPLATE


def choose(rows: list, tokenizer) -> str | None:
    """Where rows carry tools or reasoning and the tokenizer's own chat template does not render the first such
    row whole, the tokenizer is given TEMPLATE (and keeps it: the run saves it, exports carry it). Returns why, to
    be said and recorded; None where nothing changed."""
    first = next((r for r in rows if carries_tools(r)), None)
    if first is None:
        return None
    own = getattr(tokenizer, "chat_template", None)
    if own == TEMPLATE:
        return f"{NAME}, as before"
    if renders_whole(first, tools_of(first), tokenizer):
        return None
    tokenizer.chat_template = TEMPLATE
    what = "tool calls" if any(m.get("tool_calls") or m["role"] == "tool" for m in first) or tools_of(first) \
        else "reasoning"
    return (f"{NAME} (Hermes <tool_call> JSON, as Qwen2.5): the model's own chat template "
            f"{'does not render ' + what if own else 'is missing'}")


CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_START = '<tool_call>\n{"name": '  # how TEMPLATE begins a call: a forced call's reply starts so


def written(name: str, arguments: dict[str, Any]) -> str:
    """One call as TEMPLATE writes it (transformers' tojson is json.dumps with its default separators)."""
    args = json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_START}{json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def parse(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A reply in TEMPLATE's form split into its text and its calls [{"name", "arguments"}]; a <tool_call> whose
    JSON does not parse (or nests too deep for Python's parser, or names no function) is no call, and stays in the
    text."""
    calls, kept = [], text
    for found in CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
        except (json.JSONDecodeError, RecursionError):  # a model's output may nest past Python's recursion limit
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", {})
            calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
            kept = kept.replace(found.group(0), "", 1)
    return kept.strip(), calls


def check_prompt_format(rows: list, template: str) -> None:
    """A prompt format (--template '### Q: {instruction}...') has no place for tools: refused for such rows."""
    if template not in ("auto", "chat") and any(carries_tools(r) for r in rows):
        raise TunebenchError("the data carries tool calls or reasoning, which a prompt format (--template) cannot "
                             "render; leave --template at auto (the chat template renders them)")


def check_schemas(rows: list) -> None:
    """Every tool schema the rows offer is a JSON schema whose `$ref`s resolve inside it (nothing is ever fetched:
    see `valid`), each distinct one checked once when the data loads, before any weight. Such a row used to train
    every epoch and be refused only when --eval-generate scored its first call."""
    import jsonschema
    from referencing import Registry
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import specification_with


    seen: set[str] = set()
    for row in rows:
        for tool in tools_of(row) or []:
            name, schema = tool["function"]["name"], tool["function"].get("parameters") or {"type": "object"}
            key = json.dumps(schema, sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
                dialect = schema.get("$schema", "https://json-schema.org/draft/2020-12/schema")
                resolver = Registry().resolver_with_root(specification_with(dialect).create_resource(schema))
                for ref in _refs(schema):
                    resolver.lookup(ref)
            except jsonschema.SchemaError as e:
                raise TunebenchError(f"the data's tool {name}: its parameters are not a JSON schema ({e.message}); "
                                     "fix the row's tools") from None
            except Unresolvable as e:
                raise TunebenchError(f"the data's tool {name}: its parameters refer to {e.ref!r}, outside the schema; "
                                     "tunebench never fetches a dataset's references: put the definition under the "
                                     "schema's $defs") from None


def _refs(schema: Any) -> list[str]:
    """Every `$ref` in a schema, nested ones included."""
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [r for v in schema.values() for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


PATTERN_TIMEOUT_S = 0.2  # a dataset's regex run on model output: past this it has not matched
PATTERNS_TIMEOUT_S = 1.0  # all of one call's patterns together (a schema may hold many, or patternProperties many keys)


def valid(call: dict[str, Any], tools: list[dict] | None) -> bool:
    """A call names one of `tools` and its arguments are an instance of that tool's JSON schema (jsonschema).

    The schema is a dataset's, and the arguments are model output: a `$ref` is resolved only inside the schema
    (jsonschema's default registry would fetch http(s):// and file:// references, with no timeout), and a
    `pattern` runs with a time limit (the `regex` module's; `re` has none, and a nested repetition can take
    hours on one answer; additionalProperties' matching of patternProperties' keys too); a pattern that cannot
    decide in PATTERN_TIMEOUT_S counts as not matched, and so does every pattern once the call's have taken
    PATTERNS_TIMEOUT_S together. A schema pairing patternProperties with unevaluatedProperties (matched by `re`
    inside jsonschema) is refused."""
    import jsonschema
    from referencing import Registry
    from referencing.exceptions import Unresolvable

    schema = next((t["function"].get("parameters") for t in tools or [] if t["function"]["name"] == call["name"]),
                  False)
    if schema is False:
        return False
    schema = schema or {"type": "object"}
    if _unbounded_patterns(schema):
        raise TunebenchError(f"tool {call['name']}'s parameters pair patternProperties with unevaluatedProperties, "
                             "whose patterns jsonschema runs with no time limit on model output; use "
                             "additionalProperties there instead")
    try:
        checker = _validator(jsonschema.validators.validator_for(schema), time.monotonic() + PATTERNS_TIMEOUT_S)
        checker.check_schema(schema)
        return checker(schema, registry=Registry()).is_valid(call["arguments"])  # empty: nothing is retrieved
    except jsonschema.SchemaError as e:
        raise TunebenchError(f"tool {call['name']}'s parameters are not a JSON schema ({e.message}); fix the row's "
                             "tools") from None
    except Unresolvable as e:
        raise TunebenchError(f"tool {call['name']}'s parameters refer to {e.ref!r}, outside the schema; tunebench "
                             "never fetches a dataset's references: put the definition under the schema's $defs") \
            from None


def _validator(cls, deadline: float):
    """`cls` (the schema's draft) with `pattern` and `patternProperties` run by the `regex` module under a time
    limit each, all of them before `deadline` (time.monotonic)."""
    import jsonschema
    import regex

    def search(pattern: str, text: str) -> bool:
        left = min(PATTERN_TIMEOUT_S, deadline - time.monotonic())
        if left <= 0:
            return False
        try:
            return regex.search(pattern, text, timeout=left) is not None
        except TimeoutError:
            return False

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for k, v in instance.items():
                if search(patrn, k):
                    yield from validator.descend(v, subschema, path=k, schema_path=patrn)

    def additional_properties(validator, extra_schema, instance, schema):
        # jsonschema's own runs patternProperties' keys through `re`, with no time limit (a 31-character key took
        # 36.7 s against a nested repetition): the same rule, each key through `search`
        if not validator.is_type(instance, "object"):
            return
        named, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
        extras = sorted(k for k in instance if k not in named and not any(search(p, k) for p in patterns))
        if validator.is_type(extra_schema, "object"):
            for k in extras:
                yield from validator.descend(instance[k], extra_schema, path=k)
        elif not extra_schema and extras:
            yield jsonschema.ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras))})")

    return jsonschema.validators.extend(cls, {"pattern": pattern, "patternProperties": pattern_properties,
                                              "additionalProperties": additional_properties})


def _unbounded_patterns(schema: Any) -> bool:
    """Whether a schema (anywhere in it) pairs patternProperties with unevaluatedProperties, whose keys jsonschema
    matches with `re`, out of reach of any time limit."""
    if isinstance(schema, dict):
        if "patternProperties" in schema and "unevaluatedProperties" in schema:
            return True
        return any(_unbounded_patterns(v) for v in schema.values())
    return isinstance(schema, list) and any(_unbounded_patterns(v) for v in schema)
