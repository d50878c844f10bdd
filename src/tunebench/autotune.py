"""`--batch-size auto`: measure candidate micro batches on the real model and keep the fastest.

The probing logic takes a step function, so it is tested with fakes; the job supplies the real
one (forward + backward on the longest examples, so memory is the worst case).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Probe:
    micro_batch_size: int
    tokens_per_s: float | None
    peak_memory_mb: float | None
    status: str  # ok | oom | over budget | skipped: predicted over budget


@dataclass(frozen=True)
class Result:
    micro_batch_size: int
    probes: tuple[Probe, ...]
    reason: str

    def to_dict(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "probes": [asdict(p) for p in self.probes],
                "reason": self.reason}

    @staticmethod
    def from_dict(d: dict) -> Result:
        return Result(d["micro_batch_size"], tuple(Probe(**p) for p in d["probes"]), d["reason"])


def candidates(effective_batch_size: int) -> list[int]:
    """Micro batches that divide the effective batch, so accumulation keeps it exact."""
    return [m for m in range(1, effective_batch_size + 1) if effective_batch_size % m == 0]


StepFn = Callable[[int], tuple[float, float]]  # micro batch -> (tokens/s, peak memory MB)


def probe(step: StepFn, sizes: list[int], budget_mb: float, baseline_mb: float,
          is_oom: Callable[[BaseException], bool]) -> Result:
    """Try sizes in increasing order; stop at the first OOM, or before one predicted to exceed the budget.

    Memory above the baseline grows about linearly with the micro batch, so the next size's peak is
    predicted from the last one's and never tried when it would not fit (no swap, no OOM killer).
    """
    probes: list[Probe] = []
    last: tuple[int, float] | None = None
    for size in sorted(sizes):
        if last is not None:
            predicted = baseline_mb + (last[1] - baseline_mb) * size / last[0]
            if predicted > budget_mb:
                probes.append(Probe(size, None, round(predicted, 1), "skipped: predicted over budget"))
                break
        try:
            tokens_per_s, peak = step(size)
        except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else re-raises
            if not is_oom(e):
                raise
            probes.append(Probe(size, None, None, "oom"))
            break
        if peak > budget_mb:
            probes.append(Probe(size, round(tokens_per_s, 1), round(peak, 1), "over budget"))
            break
        probes.append(Probe(size, round(tokens_per_s, 1), round(peak, 1), "ok"))
        last = (size, peak)
    ok = [p for p in probes if p.status == "ok"]
    if not ok:
        return Result(0, tuple(probes), "no micro batch fits")
    best = max(ok, key=lambda p: p.tokens_per_s or 0)
    return Result(best.micro_batch_size, tuple(probes),
                  f"fastest measured: {best.tokens_per_s:,.0f} tokens/s of {len(ok)} that fit")


def _entries(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}  # a damaged cache is remeasured, never trusted


def cached_value(path: Path, key: str) -> dict | None:
    """A measured decision cached per machine and run shape, so the next run starts at once."""
    return _entries(path).get(key)


def store_value(path: Path, key: str, value: dict) -> None:
    data = _entries(path)
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def cached(path: Path, key: str) -> Result | None:
    entry = cached_value(path, key)
    return Result.from_dict(entry) if entry else None


def store(path: Path, key: str, result: Result) -> None:
    store_value(path, key, result.to_dict())


def format_table(result: Result) -> str:
    lines = ["  micro_batch  tokens/s   peak MB  status"]
    for p in result.probes:
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        mem = f"{p.peak_memory_mb:,.0f}" if p.peak_memory_mb else "-"
        mark = " <- chosen" if p.micro_batch_size == result.micro_batch_size else ""
        lines.append(f"  {p.micro_batch_size:>11}  {tps:>8}  {mem:>8}  {p.status}{mark}")
    return "\n".join(lines)
