"""`export --quant auto`: the smallest GGUF type whose task score, with llama.cpp answering the run's held-out
rows, is shown to be within a tolerance of the unquantized (f16) file's.

Each type is written as `export` writes it (so the file scored is the file that ships), checked for agreement
with the merged model as every export is (a type that fails is skipped, with the check's line), then ordered by
its real size: llama.cpp writes tensors whose rows are not whole 256-value blocks in a fallback type, so on a
small model a K-quant can be larger than a legacy type of more bits.

A tie of means on a few rows is no evidence that two types answer alike (8 rows once tied q2_k with f16, a file
agreeing with the model on 61% of next tokens). So each type is compared with f16 row by row: a bootstrap over
the rows of the mean score difference (the paired bootstrap of MT evaluation, Koehn 2004) gives a one-sided 95%
bound, and a type is within the tolerance only when that bound is, on at least MIN_ROWS rows. From the smallest
up, types are scored until one is shown within. When the rows cannot tell the types from f16, the safest
quantized type (q8_0) ships, unless it is shown worse, and the reason says how many rows would decide; f16 is
kept when every type is shown worse. The table of every type tried, and each type's answers (from which its
scores are recomputed), go beside the file.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.data import readers
from tunebench.model import llama_cpp_tools, quality
from tunebench.settings.rundir import RunDir

# Every type llama.cpp's quantizer (or tunebench's writer) makes below f16, in order of nominal bits per weight
CANDIDATES = ("q2_k", "q3_k_m", "q4_0", "q4_k_s", "q4_k_m", "q4_1", "q5_0", "q5_k_s", "q5_k_m", "q5_1", "q6_k",
              "q8_0")
REFERENCE = "f16"  # GGUF's default export: the weights as trained, to 16 bits
SAFE = "q8_0"  # shipped when the rows cannot separate the smaller types from f16: the least lossy quantized type
ROWS = 32  # held-out rows each type answers
MIN_ROWS = 20  # fewer rows decide nothing: a bootstrap's bound on a handful of rows is itself noise
TOLERANCE = 1.0  # points of the metric (ROUGE-L and chrF run 0-100) a type may lose against the reference
CONFIDENCE = 0.95  # of the one-sided bound on a type's mean loss against the reference
DRAWS = 2000  # bootstrap resamples of the rows (seeded: the same rows give the same pick)


@dataclass
class Tried:
    quant: str
    bytes: int | None = None
    score: float | None = None  # the metric, on the held-out rows, in llama.cpp
    tokens_per_s: float | None = None
    rows: int | None = None  # held-out rows it answered
    outcome: str = ""  # picked | within tolerance | outside tolerance | cannot tell | skipped: ... | not scored: ...
    scored_file: str | None = None  # the file whose answers were scored (the type's own)
    vs_reference: list[float] | None = None  # [low, high]: the bootstrap bounds of its mean difference from f16
    per_row: list[float] | None = None  # each row's score, which the bounds resample


@dataclass(frozen=True)
class Settings:
    rows: int = ROWS
    tolerance: float = TOLERANCE
    metric: str = "rougeL"
    max_new_tokens: int = 128
    types: tuple[str, ...] = CANDIDATES  # the types tried (--quant-types), f16 always the reference

    def check(self) -> None:
        if self.rows < 1 or self.tolerance < 0 or self.metric not in quality.OBJECTIVES:
            raise TunebenchError(f"--quant auto needs --quant-rows 1 or more, --quant-tolerance 0 or more and "
                                 f"--quant-metric one of {', '.join(quality.OBJECTIVES)}; got {self.rows}, "
                                 f"{self.tolerance} and {self.metric!r}")
        unknown = [q for q in self.types if q not in CANDIDATES]
        if unknown or not self.types:
            raise TunebenchError(f"--quant-types {','.join(self.types)}: "
                                 + (f"{', '.join(unknown)} is not a type --quant auto tries" if unknown else "no type")
                                 + f"; give some of {','.join(CANDIDATES)} (f16 is always the reference)")


def held_out(run_dir: Path, settings: Settings):
    """The run's held-out rows, refused before any weight loads when there are none to score."""
    from tunebench.jobs.evaluate import HeldOut

    settings.check()
    llama_cpp_tools.check_available(converter_needed=False)  # llama.cpp answers the rows
    run = RunDir(run_dir)
    if not run.config_file.is_file() or run.kind() == "pretrain":
        raise TunebenchError(f"--quant auto scores a fine-tuned run's task on its held-out rows, and '{run_dir}' is "
                             "not one (a pretraining run has no task): pick a type with --quant (q8_0, q4_k_m, ...)")
    data = run.train_config().data
    if data.path not in readers.BUILTIN and not Path(data.path).exists():  # the built-in data ships with tunebench
        raise TunebenchError(f"--quant auto answers the run's held-out rows from '{data.path}', which is gone; "
                             "restore it, or pick a type with --quant")
    held = HeldOut.of(str(run_dir), data)
    if not held.rows:
        raise TunebenchError(f"'{run_dir}' has no held-out rows to score types on; pick a type with --quant")
    return held


def bounds(diffs: list[float], confidence: float = CONFIDENCE, draws: int = DRAWS) -> tuple[float, float]:
    """One-sided `confidence` bounds (low, high) on the mean of paired per-row differences, by a percentile
    bootstrap over the rows. Written here: scipy.stats.bootstrap does this, and scipy is not a dependency."""
    d = np.asarray(diffs, dtype=np.float64)
    means = d[np.random.default_rng(0).integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    return float(np.quantile(means, 1 - confidence)), float(np.quantile(means, confidence))


def judge(row: Tried, ref: Tried, settings: Settings) -> str:
    """"within tolerance" (its bound on the loss is inside it, on MIN_ROWS rows or more), "outside tolerance"
    (shown to lose more), or "cannot tell" (the rows allow either)."""
    low, high = bounds([q - f for q, f in zip(row.per_row, ref.per_row)])
    row.vs_reference = [round(low, 2), round(high, 2)]
    if high < -settings.tolerance:
        return "outside tolerance"
    if not any(ref.per_row):  # f16 scores 0 on every row (an untrained run): no type can lose anything there
        return "cannot tell"
    if low >= -settings.tolerance and len(row.per_row) >= MIN_ROWS:
        return "within tolerance"
    return "cannot tell"


def pick(write: Callable, held, settings: Settings, work: Path) -> tuple[str, Path, list[Tried]]:
    """`write(quant, path)` writes and checks one type (raising TunebenchError when its check fails); returns the
    type picked, its file (in `work`) and the table."""
    reference = work / f"{REFERENCE}.gguf"
    write(REFERENCE, reference)
    ref = _score(held, reference, REFERENCE, settings, work)
    tried = [ref]
    written = []
    for quant in (q for q in CANDIDATES if q in settings.types):
        path = work / f"{quant}.gguf"
        try:
            write(quant, path)
        except TunebenchError as e:  # the agreement check failed: this type is not offered
            tried.append(Tried(quant, outcome=f"skipped: {e}"))
            continue
        written.append((path.stat().st_size, CANDIDATES.index(quant), quant, path))  # ties: fewer nominal bits
    few = ref.rows < MIN_ROWS  # no type can be shown within: only the safe type is scored
    chosen = REFERENCE
    for size, _, quant, path in sorted(written):
        why = ("not smaller than f16" if size >= reference.stat().st_size else f"{chosen} is no larger"
               if chosen != REFERENCE else f"{ref.rows} rows cannot show it within (fewer than {MIN_ROWS})"
               if few and quant != SAFE else None)
        if why:
            tried.append(Tried(quant, size, outcome=f"not scored: {why}"))
            continue
        row = _score(held, path, quant, settings, work)
        row.outcome = judge(row, ref, settings)
        tried.append(row)
        if row.outcome == "within tolerance":
            chosen = quant
    safe = next((t for t in tried if t.quant == SAFE and t.score is not None), None)
    if chosen == REFERENCE and safe is not None and safe.outcome == "cannot tell":
        chosen = SAFE
    for row in tried:
        if row.quant == chosen:
            row.outcome = "picked"
    return chosen, work / f"{chosen}.gguf", tried


def _score(held, path: Path, quant: str, settings: Settings, work: Path) -> Tried:
    scores = held.score_gguf(path, settings.rows, settings.max_new_tokens, work / f"answers-{quant}.jsonl")
    if scores[settings.metric] is None:  # exact match where the references are not GSM8K-style
        raise TunebenchError(f"--quant-metric {settings.metric} has no value on this run's rows (exact match needs "
                             "GSM8K-style '#### answer' references); use --quant-metric rougeL or chrf")
    return Tried(quant, path.stat().st_size, scores[settings.metric], scores["gen_tokens_per_s"], scores["generated"],
                 "reference", Path(scores["model"]).name, per_row=[round(v, 4) for v in scores["per_row"][settings.metric]])


def table(tried: list[Tried], settings: Settings) -> str:
    """The types tried, as printed and recorded: size, score, its bounds against f16, tokens/s and what became of
    each."""
    label = quality.LABELS.get(settings.metric, settings.metric)
    head = ("type", "MB", label, f"vs f16 ({CONFIDENCE:.0%})", "tokens/s", "")
    body = [(t.quant, "-" if t.bytes is None else f"{t.bytes / 2**20:.2f}", _cell(t.score),
             f"{t.vs_reference[0]:+.1f} to {t.vs_reference[1]:+.1f}" if t.vs_reference else "-",
             _cell(t.tokens_per_s), t.outcome) for t in tried]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *body))


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def reason(chosen: str, tried: list[Tried], settings: Settings) -> str:
    ref = tried[0]
    label = quality.LABELS.get(settings.metric, settings.metric)
    undecided = [t.quant for t in tried[1:] if t.outcome == "cannot tell" or "rows cannot show" in t.outcome]
    decide = (f"hold out more rows ({MIN_ROWS} at least; the run holds out {ref.rows}: --eval-fraction) to decide"
              if ref.rows < settings.rows else f"give --quant-rows {max(MIN_ROWS, 2 * ref.rows)} or more to decide")
    if chosen == REFERENCE:
        return (f"every quantized type scored lost more than {settings.tolerance:g} {label} against f16's "
                f"{ref.score:.1f} on {ref.rows} held-out rows in llama.cpp, so f16 is kept")
    row = next(t for t in tried if t.quant == chosen)
    if row.quant == SAFE and row.vs_reference and not any(ref.per_row):
        return (f"f16 scores 0 {label} on every one of {ref.rows} held-out rows (an untrained run?), so they cannot "
                f"separate any type from it; shipped {SAFE}, the safest quantized type; score by --quant-metric chrf, "
                "or pick a type with --quant")
    if row.quant == SAFE and row.vs_reference and (ref.rows < MIN_ROWS or row.vs_reference[0] < -settings.tolerance):
        smaller = ", ".join(undecided) or "the smaller types"
        return (f"{ref.rows} held-out rows cannot separate {smaller} from f16 within {settings.tolerance:g} {label}; "
                f"shipped {SAFE}, the safest quantized type ({row.score:.1f} against f16's {ref.score:.1f}); {decide}")
    return (f"{chosen} is the smallest type whose {label} ({row.score:.1f}) is within {settings.tolerance:g} of "
            f"f16's ({ref.score:.1f}) on {ref.rows} held-out rows answered by llama.cpp, at {CONFIDENCE:.0%} "
            f"confidence (its mean difference is above {row.vs_reference[0]:+.2f})")


def record(directory: Path, chosen: str, tried: list[Tried], settings: Settings, held, work: Path) -> None:
    """quant-auto.json (the settings, the pick, every row) and each scored type's answers, into `directory`."""
    write_json(directory / "quant-auto.json", {"picked": chosen, "reason": reason(chosen, tried, settings),
                                               "settings": asdict(settings), "rows_from": held.where,
                                               "types": [asdict(t) for t in tried]})
    for answers in work.glob("answers-*.jsonl"):
        shutil.copyfile(answers, directory / answers.name)
