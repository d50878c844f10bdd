"""Messages -> token ids and a loss mask, cached on disk per (data, tokenizer, template, max_length).

Loss is on the assistant's tokens only (`train_on: response`) unless asked for all tokens; the
model also learns to stop, because every response ends with the EOS token.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.data import formats, readers, toolcalls
from tunebench.settings.finetune import DataConfig

DEFAULT_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
FORMAT_VERSION = 4  # bump when tokenization changes, to invalidate caches

# ChatML: the prompt format of multi-turn data on a tokenizer without a chat template of its own (and of
# the tiny preset's tokenizer).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Tokenized:
    """All examples: example i is ids[offsets[i]:offsets[i+1]], with loss where mask is 1."""

    ids: np.ndarray  # (N_tokens,) int32
    mask: np.ndarray  # (N_tokens,) int8: 1 where the token is a loss target
    offsets: np.ndarray  # (N_examples + 1,) int64
    fmt: str
    dropped: int  # examples with no loss token left after truncation
    rows: np.ndarray  # (N_examples,) int64: the example (its index in Examples.messages) each one came from
    unrendered: int = 0  # rows left out (--on-unrenderable drop): the template would not render them whole

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def segments(messages: formats.Messages, tokenizer, cfg: DataConfig) -> list[tuple[str, bool]]:
    """Split one example's text into (text, is_loss_target) pieces: the loss on each assistant turn (its tool
    calls, and its reasoning unless `train_reasoning` is off; the last turn alone under `train_on: final`), never
    on a prompt, a tool result or the tool definitions unless `train_on: all`."""
    all_tokens = cfg.train_on == "all"
    eos = tokenizer.eos_token or ""
    if messages and messages[0]["role"] == "text":
        return [(messages[0]["content"] + eos, True)]
    plain = not formats.carries_tools(messages)
    if plain and len(messages) == 2 and \
            (prompt := _instruction_prompt(messages[:1], tokenizer, cfg.template)) is not None:
        return [(prompt, all_tokens), (messages[1]["content"] + eos, True)]
    if cfg.template not in ("auto", "chat") or not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE  # multi-turn data on a tokenizer without one: ChatML
    tools = formats.tools_of(messages)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant") if cfg.train_on == "final" else None
    out: list[tuple[str, bool]] = []
    prev = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = toolcalls.render(messages[:i], tools, tokenizer, add_generation_prompt=True)
        full = toolcalls.render(messages[: i + 1], tools, tokenizer)
        if not prompt.startswith(prev) or not full.startswith(prompt):
            raise TunebenchError(
                "the tokenizer's chat template does not render turns as prefixes of each other; "
                "pass --template with a prompt format such as '### Instruction:\\n{instruction}\\n\\n### Response:\\n'"
            )
        reply = full[len(prompt):]
        if eos and eos not in reply:
            reply += eos
        learn = all_tokens or last in (None, i)
        out.append((prompt[len(prev):], all_tokens))
        trace = m.get("reasoning_content")
        if trace and not cfg.train_reasoning and trace in reply:  # the trace and what closes it, unlearned
            end = reply.index(trace) + len(trace)
            close = re.match(r"\s*</\w+>\s*", reply[end:])
            end += close.end() if close else 0
            out += [(reply[:end], all_tokens), (reply[end:], learn)]
        else:
            out.append((reply, learn))
        prev = full
    return out


def _instruction_prompt(prompt_turns: formats.Messages, tokenizer, template: str) -> str | None:
    """The prompt of a single user turn in the instruction format (a custom `template`, else
    DEFAULT_PROMPT when the tokenizer has no chat template); None where a chat template renders it."""
    custom = template not in ("auto", "chat")
    if (not custom and getattr(tokenizer, "chat_template", None)) or len(prompt_turns) != 1 \
            or prompt_turns[0]["role"] != "user":
        return None
    try:
        return (template if custom else DEFAULT_PROMPT).format(instruction=prompt_turns[0]["content"])
    except (KeyError, IndexError) as e:
        raise TunebenchError(f"--template must contain {{instruction}} and no other fields, got {template!r}") from e


def render_prompt(messages: formats.Messages, tokenizer, template: str = "auto") -> str:
    """The text a model fine-tuned with `template` saw before each reply: what segments puts ahead of
    the response, so `generate` and `chat` prompt a fine-tune the way it was trained."""
    if formats.carries_tools(messages) and getattr(tokenizer, "chat_template", None):
        return toolcalls.render(messages, formats.tools_of(messages), tokenizer, add_generation_prompt=True)
    prompt = _instruction_prompt(messages, tokenizer, template)
    if prompt is not None:
        return prompt
    if template not in ("auto", "chat") or not getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def use_template(rows: list[formats.Messages], tokenizer, cfg: DataConfig) -> str | None:
    """Where rows carry tool calls or reasoning: refused under a prompt format, and the tokenizer given
    tunebench's tool template where its own does not render them (data.toolcalls.choose); returns why, or None."""
    toolcalls.check_prompt_format(rows, cfg.template)
    return toolcalls.choose(rows, tokenizer)


def marked(messages: formats.Messages, tokenizer, cfg: DataConfig, start: str = "[[", end: str = "]]") -> str:
    """One row as the model sees it, each loss part between `start` and `end`."""
    return "".join(f"{start}{text}{end}" if loss else text for text, loss in segments(messages, tokenizer, cfg))


def _fingerprint(path: Path, tokenizer, cfg: DataConfig) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stat = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    tok = [
        tokenizer.name_or_path, len(tokenizer), tokenizer.eos_token,
        hashlib.sha256(str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest(),
        hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest(),
    ]
    fields = [cfg.format, cfg.instruction_column, cfg.input_column, cfg.response_column, cfg.messages_column,
              cfg.text_column, cfg.template, cfg.train_on, cfg.train_reasoning, cfg.on_unrenderable, cfg.max_length,
              FORMAT_VERSION]
    return hashlib.sha256(json.dumps([stat, tok, fields], default=str).encode()).hexdigest()[:20]


def tokenize_messages(
    examples: list[formats.Messages], tokenizer, cfg: DataConfig, fmt: str
) -> Tokenized:
    pieces = [segments(m, tokenizer, cfg) for m in examples]
    unrendered = 0
    for n, (m, seg) in enumerate(zip(examples, pieces), 1):
        if formats.carries_tools(m) and (lost := toolcalls.missing(m, formats.tools_of(m), "".join(t for t, _ in seg))):
            if cfg.on_unrenderable != "drop":
                raise TunebenchError(f"row {n}'s text lacks {', '.join(lost[:3])}: the chat template does not render "
                                     "them, and the row would train half-rendered; use a model whose template does, or "
                                     "--on-unrenderable drop to leave such rows out")
            pieces[n - 1], unrendered = None, unrendered + 1
    flat = [text for seg in pieces if seg is not None for text, _ in seg]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    ids, masks, offsets, dropped, k, rows = [], [], [0], 0, 0, []
    for row, seg in enumerate(pieces):
        if seg is None:  # left out above: not renderable
            continue
        ex_ids: list[int] = []
        ex_mask: list[int] = []
        for _, trainable in seg:
            piece = encoded[k]
            k += 1
            ex_ids += piece
            ex_mask += [int(trainable)] * len(piece)
        ex_ids, ex_mask = ex_ids[: cfg.max_length], ex_mask[: cfg.max_length]
        if sum(ex_mask[1:]) == 0:  # position 0 is never predicted
            dropped += 1
            continue
        ids += ex_ids
        masks += ex_mask
        offsets.append(offsets[-1] + len(ex_ids))
        rows.append(row)
    return Tokenized(
        np.asarray(ids, dtype=np.int32), np.asarray(masks, dtype=np.int8), np.asarray(offsets, dtype=np.int64),
        fmt, dropped, np.asarray(rows, dtype=np.int64), unrendered,
    )


def load_tokenized(cfg: DataConfig, tokenizer, cache_root: Path | None,
                   examples: formats.Examples | None = None) -> Tokenized:
    """Read, format and tokenize a dataset (`examples`, when already read), reusing the on-disk cache
    when nothing changed."""
    path = readers.resolve_path(cfg.path)
    examples = examples or formats.load_examples(cfg)
    if why := use_template(examples.messages, tokenizer, cfg):  # before the cache key, which holds the template
        print(f"data: chat template {why}")
    cache_file = None
    if cache_root is not None:
        cache_file = cache_root / "tokenized" / f"{_fingerprint(path, tokenizer, cfg)}.npz"
        if cache_file.exists():
            try:
                with np.load(cache_file) as z:
                    return Tokenized(z["ids"], z["mask"], z["offsets"], str(z["fmt"]), int(z["dropped"]), z["rows"],
                                     int(z["unrendered"]))
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # torn or damaged
                print(f"data: the tokenized cache {cache_file.name} does not load ({type(e).__name__}); "
                      "tokenizing again")
    data = tokenize_messages(examples.messages, tokenizer, cfg, examples.fmt)
    if len(data) == 0:
        raise TunebenchError(
            f"dataset '{cfg.path}' is empty after tokenization: all {data.dropped} examples lost their response "
            f"to truncation at --max-length {cfg.max_length}; raise --max-length or shorten the prompts"
        )
    if data.unrendered:
        print(f"data: {data.unrendered} rows left out (--on-unrenderable drop): the chat template does not render "
              "their tool calls or reasoning whole")
    if cache_file is not None:
        with atomic_file(cache_file, suffix=".npz") as tmp:
            np.savez(tmp, ids=data.ids, mask=data.mask, offsets=data.offsets, fmt=data.fmt, dropped=data.dropped,
                     rows=data.rows, unrendered=data.unrendered)
    return data


def split(n: int, eval_fraction: float, seed: int, max_samples: int | None, eval_samples: int | None = None):
    """Seeded (train, eval) index arrays; `max_samples` caps the rows used before the split."""
    order = np.random.default_rng(seed).permutation(n)
    if max_samples is not None:
        order = order[:max_samples]
    n_eval = int(round(len(order) * eval_fraction)) if eval_fraction > 0 and len(order) >= 2 else 0
    n_eval = max(1, n_eval) if eval_fraction > 0 and len(order) >= 2 else 0
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    if eval_samples is not None:
        eval_idx = eval_idx[:eval_samples]
    return np.sort(train_idx), np.sort(eval_idx)
