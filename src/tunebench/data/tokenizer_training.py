"""`tunebench tokenizer train`: a tokenizer trained on your corpus with Hugging Face `tokenizers`.

Byte-level BPE by default (any byte sequence encodes, no unknown tokens), or unigram, WordPiece,
or one token per character. The corpus streams through the trainer, one piece at a time; every
tenth piece is held out to measure the result. Saved as a directory `AutoTokenizer` loads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from tunebench.core.durable import atomic_dir
from tunebench.core.errors import TunebenchError
from tunebench.data import text

TYPES = ("bpe", "unigram", "wordpiece", "char")
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
HELD_OUT_EVERY = 10  # every tenth piece is held out for bytes per token
PIECE_CHARS = 2048  # plain text reaches the trainer in pieces of about this size
HELD_OUT_MAX_CHARS = 2_000_000
FORMAT = 1  # bump when training changes, to retrain tokenizers cached by `tunebench pretrain`


def build(kind: str, vocab_size: int):
    """(empty tokenizer, its trainer) of `kind`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = list(SPECIALS.values())
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                          unk_token=SPECIALS["unk_token"])
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=SPECIALS["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    elif kind == "char":
        tok = Tokenizer(models.WordLevel(unk_token=SPECIALS["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                            min_frequency=1)
    else:
        raise TunebenchError(f"--type '{kind}' is not one of {', '.join(TYPES)}")
    return tok, trainer


def train(data: list[str], vocab_size: int, kind: str = "bpe", output_dir: str | Path = "tokenizer",
          text_column: str = "text", quiet: bool = False, overwrite: bool = False) -> dict:
    """Train, save and measure a tokenizer; returns what was reached. An output directory that already holds
    something is refused unless `overwrite` (a tokenizer replaced under a trained model changes its text); the
    new one is written beside it and renamed into place, so a kill leaves the old one whole."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIALS) + 1:
        raise TunebenchError(f"--vocab-size {vocab_size} is too small; pass at least {len(SPECIALS) + 1}")
    if kind == "bpe" and vocab_size < 256 + len(SPECIALS):
        raise TunebenchError(f"--vocab-size {vocab_size} is below byte-level BPE's 256 bytes + {len(SPECIALS)} "
                             f"specials; pass at least {256 + len(SPECIALS)}, or --type char")
    for spec in data:
        if not text.files(spec) and spec.startswith((".", "/", "~")):
            raise TunebenchError(f"data file '{spec}' not found; check --data")
    if not any(piece.strip() for spec in data for piece, _ in text.pieces(spec, text_column, piece_chars=PIECE_CHARS)):
        raise TunebenchError(f"--data {' '.join(data)} holds no text to learn a vocabulary from (column "
                             f"'{text_column}' for records); point --data at a corpus, or set --text-column")
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise TunebenchError(f"--output-dir '{out}' already holds files; pick another directory, or pass --overwrite "
                             "to replace them")
    tok, trainer = build(kind, vocab_size)
    held_out: list[str] = []

    def corpus() -> Iterator[str]:
        held = 0
        for spec in data:
            for i, (piece, _) in enumerate(text.pieces(spec, text_column, piece_chars=PIECE_CHARS)):
                if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 and held < HELD_OUT_MAX_CHARS:
                    held_out.append(piece)
                    held += len(piece)
                elif piece:
                    yield piece

    t0 = time.perf_counter()
    tok.train_from_iterator(corpus(), trainer)
    seconds = time.perf_counter() - t0
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS)
    with atomic_dir(out) as tmp:
        fast.save_pretrained(tmp)
    n_bytes = sum(len(p.encode()) for p in held_out)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(held_out)) if held_out else 0
    result = {"type": kind, "vocab_size": tok.get_vocab_size(), "vocab_size_asked": vocab_size,
              "train_seconds": round(seconds, 2), "held_out_bytes": n_bytes,
              "bytes_per_token": round(n_bytes / n_tokens, 3) if n_tokens else None, "output_dir": str(out)}
    if not quiet:
        reached = result["vocab_size"]
        note = "" if reached == vocab_size else f" (asked for {vocab_size:,}: the corpus yields no more)"
        per = f"{result['bytes_per_token']} bytes per token on {n_bytes:,} held-out bytes" if n_tokens \
            else "no held-out text (corpus under 10 pieces)"
        print(f"{kind} tokenizer: vocabulary {reached:,}{note}, trained in {seconds:.1f} s; {per}; saved to {out}")
    return result
