"""`export --quant auto`: the smallest GGUF type whose task score, with llama.cpp answering the run's held-out
rows, is within a tolerance of the unquantized (f16) file's.

Each type is written as `export` writes it (so the file scored is the file that ships), checked for agreement
with the merged model as every export is (a type that fails is skipped, with the check's line), then ordered by
its real size: llama.cpp writes tensors whose rows are not whole 256-value blocks in a fallback type, so on a
small model a K-quant can be larger than a legacy type of more bits. From the smallest up, each is scored until
one is within the tolerance; the f16 file is kept when none is. The table of every type tried, and each type's
answers (from which its scores are recomputed), go beside the file.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tunebench.core.errors import TunebenchError
from tunebench.model import quality

# Every type llama.cpp's quantizer (or tunebench's writer) makes below f16, in order of nominal bits per weight
CANDIDATES = ("q2_k", "q3_k_m", "q4_0", "q4_k_s", "q4_k_m", "q4_1", "q5_0", "q5_k_s", "q5_k_m", "q5_1", "q6_k",
              "q8_0")
REFERENCE = "f16"  # GGUF's default export: the weights as trained, to 16 bits
ROWS = 32  # held-out rows each type answers
TOLERANCE = 1.0  # points of the metric (ROUGE-L and chrF run 0-100) a type may lose against the reference


@dataclass
class Tried:
    quant: str
    bytes: int | None = None
    score: float | None = None  # the metric, on the held-out rows, in llama.cpp
    tokens_per_s: float | None = None
    rows: int | None = None  # held-out rows it answered
    outcome: str = ""  # picked | within tolerance | outside tolerance | skipped: ... | not scored: ...


@dataclass(frozen=True)
class Settings:
    rows: int = ROWS
    tolerance: float = TOLERANCE
    metric: str = "rougeL"
    max_new_tokens: int = 128

    def check(self) -> None:
        if self.rows < 1 or self.tolerance < 0 or self.metric not in quality.OBJECTIVES:
            raise TunebenchError(f"--quant auto needs --quant-rows 1 or more, --quant-tolerance 0 or more and "
                                 f"--quant-metric one of {', '.join(quality.OBJECTIVES)}; got {self.rows}, "
                                 f"{self.tolerance} and {self.metric!r}")


def held_out(run_dir: Path, settings: Settings):
    """The run's held-out rows, refused before any weight loads when there are none to score."""
    from tunebench.data import readers
    from tunebench.jobs.evaluate import HeldOut
    from tunebench.model import llama_cpp_tools
    from tunebench.settings.rundir import RunDir

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


def pick(write: Callable, held, settings: Settings, work: Path) -> tuple[str, Path, list[Tried]]:
    """`write(quant, path)` writes and checks one type (raising TunebenchError when its check fails); returns the
    type picked, its file (in `work`) and the table."""
    reference = work / f"{REFERENCE}.gguf"
    write(REFERENCE, reference)
    ref = _score(held, reference, REFERENCE, settings, work)
    tried = [ref]
    written = []
    for quant in CANDIDATES:
        path = work / f"{quant}.gguf"
        try:
            write(quant, path)
        except TunebenchError as e:  # the agreement check failed: this type is not offered
            tried.append(Tried(quant, outcome=f"skipped: {e}"))
            continue
        written.append((path.stat().st_size, CANDIDATES.index(quant), quant, path))  # ties: fewer nominal bits
    floor = ref.score - settings.tolerance
    chosen = REFERENCE
    for size, _, quant, path in sorted(written):
        if size >= reference.stat().st_size or chosen != REFERENCE:
            tried.append(Tried(quant, size, outcome="not scored: " + (
                "not smaller than f16" if size >= reference.stat().st_size else f"{chosen} is no larger")))
            continue
        row = _score(held, path, quant, settings, work)
        row.outcome = "within tolerance" if row.score >= floor else "outside tolerance"
        tried.append(row)
        if row.score >= floor:
            chosen = quant
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
                 "reference")


def table(tried: list[Tried], settings: Settings) -> str:
    """The types tried, as printed and recorded: size, score, tokens/s and what became of each."""
    label = quality.LABELS.get(settings.metric, settings.metric)
    head = ("type", "MB", label, "tokens/s", "")
    body = [(t.quant, "-" if t.bytes is None else f"{t.bytes / 2**20:.2f}", _cell(t.score), _cell(t.tokens_per_s),
             t.outcome) for t in tried]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *body))


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def reason(chosen: str, tried: list[Tried], settings: Settings) -> str:
    ref = tried[0]
    label = quality.LABELS.get(settings.metric, settings.metric)
    if chosen == REFERENCE:
        return (f"no quantized type kept {label} within {settings.tolerance:g} of f16's {ref.score:.1f} on "
                f"{ref.rows} held-out rows in llama.cpp, so f16 is kept")
    row = next(t for t in tried if t.quant == chosen)
    return (f"{chosen} is the smallest type whose {label} ({row.score:.1f}) is within {settings.tolerance:g} of "
            f"f16's ({ref.score:.1f}) on {ref.rows} held-out rows answered by llama.cpp")


def record(directory: Path, chosen: str, tried: list[Tried], settings: Settings, held, work: Path) -> None:
    """quant-auto.json (the settings, the pick, every row) and each scored type's answers, into `directory`."""
    from tunebench.core.jsonfile import write_json

    write_json(directory / "quant-auto.json", {"picked": chosen, "reason": reason(chosen, tried, settings),
                                               "settings": asdict(settings), "rows_from": held.where,
                                               "types": [asdict(t) for t in tried]})
    for answers in work.glob("answers-*.jsonl"):
        shutil.copyfile(answers, directory / answers.name)
