"""Messages -> token ids and a loss mask, cached on disk per (data, tokenizer, template, max_length).

Loss is on the assistant's tokens only (`train_on: response`) unless asked for all tokens; the
model also learns to stop, because every response ends with the EOS token.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.data import formats, readers
from tunebench.settings.finetune import DataConfig

DEFAULT_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
FORMAT_VERSION = 3  # bump when tokenization changes, to invalidate caches

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

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def segments(messages: formats.Messages, tokenizer, cfg: DataConfig) -> list[tuple[str, bool]]:
    """Split one example's text into (text, is_loss_target) pieces."""
    all_tokens = cfg.train_on == "all"
    eos = tokenizer.eos_token or ""
    if messages and messages[0]["role"] == "text":
        return [(messages[0]["content"] + eos, True)]
    if len(messages) == 2 and (prompt := _instruction_prompt(messages[:1], tokenizer, cfg.template)) is not None:
        return [(prompt, all_tokens), (messages[1]["content"] + eos, True)]
    if cfg.template not in ("auto", "chat") or not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE  # multi-turn data on a tokenizer without one: ChatML
    out: list[tuple[str, bool]] = []
    prev = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not prompt.startswith(prev) or not full.startswith(prompt):
            raise TunebenchError(
                "the tokenizer's chat template does not render turns as prefixes of each other; "
                "pass --template with a prompt format such as '### Instruction:\\n{instruction}\\n\\n### Response:\\n'"
            )
        reply = full[len(prompt):]
        if eos and eos not in reply:
            reply += eos
        out += [(prompt[len(prev):], all_tokens), (reply, True)]
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
    prompt = _instruction_prompt(messages, tokenizer, template)
    if prompt is not None:
        return prompt
    if template not in ("auto", "chat") or not getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _fingerprint(path: Path, tokenizer, cfg: DataConfig) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stat = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    tok = [
        tokenizer.name_or_path, len(tokenizer), tokenizer.eos_token,
        hashlib.sha256(str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest(),
        hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest(),
    ]
    fields = [cfg.format, cfg.instruction_column, cfg.input_column, cfg.response_column, cfg.messages_column,
              cfg.text_column, cfg.template, cfg.train_on, cfg.max_length, FORMAT_VERSION]
    return hashlib.sha256(json.dumps([stat, tok, fields], default=str).encode()).hexdigest()[:20]


def tokenize_messages(
    examples: list[formats.Messages], tokenizer, cfg: DataConfig, fmt: str
) -> Tokenized:
    pieces = [segments(m, tokenizer, cfg) for m in examples]
    flat = [text for seg in pieces for text, _ in seg]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    ids, masks, offsets, dropped, k, rows = [], [], [0], 0, 0, []
    for row, seg in enumerate(pieces):
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
        fmt, dropped, np.asarray(rows, dtype=np.int64),
    )


def load_tokenized(cfg: DataConfig, tokenizer, cache_root: Path | None,
                   examples: formats.Examples | None = None) -> Tokenized:
    """Read, format and tokenize a dataset (`examples`, when already read), reusing the on-disk cache
    when nothing changed."""
    path = readers.resolve_path(cfg.path)
    cache_file = None
    if cache_root is not None:
        cache_file = cache_root / "tokenized" / f"{_fingerprint(path, tokenizer, cfg)}.npz"
        if cache_file.exists():
            try:
                with np.load(cache_file) as z:
                    return Tokenized(z["ids"], z["mask"], z["offsets"], str(z["fmt"]), int(z["dropped"]), z["rows"])
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # torn or damaged
                print(f"data: the tokenized cache {cache_file.name} does not load ({type(e).__name__}); "
                      "tokenizing again")
    examples = examples or formats.load_examples(cfg)
    data = tokenize_messages(examples.messages, tokenizer, cfg, examples.fmt)
    if len(data) == 0:
        raise TunebenchError(
            f"dataset '{cfg.path}' is empty after tokenization: all {data.dropped} examples lost their response "
            f"to truncation at --max-length {cfg.max_length}; raise --max-length or shorten the prompts"
        )
    if cache_file is not None:
        with atomic_file(cache_file, suffix=".npz") as tmp:
            np.savez(tmp, ids=data.ids, mask=data.mask, offsets=data.offsets, fmt=data.fmt, dropped=data.dropped,
                     rows=data.rows)
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
