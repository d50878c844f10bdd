"""A run's plan held against what happened: the time to train, the steady speed, the first steps' extra time and
the peak memory the plan predicted, beside what the run measured, and the difference in time split by cause.

The plan predicts from what an earlier run of the same shape trained at on this machine (`learned`, below), else
from the probe (forward and backward at the widest rows, timed after a warm-up repeat; where it timed two micro
batches, each of the run's micro batches costed at its own width by `call_cost`) with a timed optimizer step added
(`with_optimizer`), corrected by what this machine's runs of the method trained at against that figure
(`probe_ratio`: those at the run's micro batch where two agree, else all of them). What the run trains is its own
batches: the plan counts their computed positions (padding included) by collating them (`planned_work`), so
padding is in the prediction and not a surprise. The run's first steps are the leading ones (in its first half)
that ran more than a quarter slower than its later half's median speed gives them; its steady speed is over the
steps after them, and the first steps' time beyond that speed is their extra (a micro batch no probe ran pays it
on some CPUs: new kernels, memory first touched).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tunebench.data.batching import IGNORE
from tunebench.training import optim
from tunebench.training.autotune import Key, cached, store
from tunebench.training.loop import LoopState

SLOW = 1.25  # a first step counts as slow when it took this much longer than the steady speed gives it
MISSED = 0.15  # a prediction off by more than this is said to have missed
SHARED = 0.2  # a run whose cores others took more than this share of (monitor.CoreShare) teaches no record: a
# towns-benchmark start trained beside the mutation table at 22 positions/s, its record kept, and the next run of
# the shape, alone, was planned at 22 for the ~180 it trained at (47 min for 5.5; 2026-12-02, a 2-core AVX2 EPYC)
SHARED_SAID = 0.05  # the share of them the closing lines mention
RATIOS = 5  # the probe-to-run ratios a machine keeps, and the speeds a shape keeps per micro batch: its last runs'
SAMPLE_MICRO_BATCHES = 512  # the plan collates at most this many of the run's micro batches to count its positions
OPTIMIZER_SAMPLE = 1 << 24  # elements the optimizer step is timed on (64 MB in fp32), scaled to the trainable count


@dataclass(frozen=True)
class Work:
    """What this rank's micro batches hold over the run: computed positions (padding included) and real tokens,
    counted from the run's own collated batches (a prefix of at most SAMPLE_MICRO_BATCHES, scaled up), and the most
    loss positions one of them holds."""

    positions: float
    tokens: float
    most_loss_positions: int = 0  # the most loss positions one micro batch holds (memory.with_logits)
    micro_batches: float = 0.0  # how many micro batches hold them


def planned_work(steps, count: int, accum: int) -> Work:
    """The positions and real tokens of a run's `count` optimizer steps of `accum` micro batches each, from
    `steps` (a fresh feed.Steps over the run's own batches: its micro batches in the order the loop takes them)."""
    at = LoopState()
    total = count * accum
    take = min(total, SAMPLE_MICRO_BATCHES)
    positions = tokens = most = 0
    batches: list = []
    for _ in range(take):
        if not batches:
            batches = steps.next(at)
        batch = batches.pop(0)
        positions += batch["input_ids"].numel()
        tokens += int(batch["attention_mask"].sum())
        most = max(most, loss_positions(batch))
    scale = total / take if take else 0.0
    return Work(positions * scale, tokens * scale, most, total)


def loss_positions(batch) -> int:
    """The positions a collated batch computes a loss at (its labels' next tokens that are not ignored; 0 without
    labels): an objective's log-probabilities are held at those (memory.with_logits)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum()) if "labels" in batch else 0


class CallCost(NamedTuple):
    """A micro batch's forward and backward as a cost it pays whatever its width plus a cost per position, fitted
    to two probes of different positions (`call_cost`, `width_cost`), and what they were."""

    fixed_s: float
    per_position_s: float
    probes: str  # "at micro 2 and 4 of the widest rows (250 and 300 a second"


def _line(points: list[tuple[int, float]], probes: str) -> CallCost | None:
    """The line through two probes' (positions, seconds); None where it says nothing sensible: more positions no
    dearer (noise), or dearer a position than the fewer were (no part paid whatever the width)."""
    (p1, t1), (p2, t2) = sorted(points)
    if p2 <= p1:
        return None
    per_position = (t2 - t1) / (p2 - p1)
    fixed = t1 - per_position * p1
    return CallCost(fixed, per_position, probes) if per_position > 0 and fixed > 0 else None


def _point(batch, tokens_per_s: float) -> tuple[int, float]:
    """(positions, seconds) of a probe of collated `batch` that ran at `tokens_per_s` real tokens a second."""
    return batch["input_ids"].numel(), int(batch["attention_mask"].sum()) / tokens_per_s


def call_cost(speeds: dict[int, float], rows: Callable[[int], dict], micro: int) -> CallCost | None:
    """The cost of one of the run's micro batches from the probe's speeds at `micro` and the next smaller size it
    measured (else the next larger), both at the widest rows (`rows(size)`, collated as the probe ran them): the
    line through their seconds against their positions. None where no second size was measured. Why: the probe
    times the widest rows only, and a forward and backward pays a cost whatever its width (the calls it makes,
    kernels launched per layer): on a 2-core Intel Xeon (SmolLM2-135M LoRA, fp32) a micro-1 step took 182 ms +
    3.35 ms a position over widths 58-125, so a run's shorter rows train slower a position than the probe's
    widest; at micro 4 the same cost is a quarter as much of a position's (2026-12-03,
    benchmarks/new-width-cost-xeon-2026-12-03/)."""
    other = max((s for s in speeds if s < micro), default=min((s for s in speeds if s > micro), default=None))
    if micro not in speeds or other is None:
        return None
    a, b = sorted((micro, other))
    return _line([_point(rows(size), speeds[size]) for size in (a, b)],
                 f"at micro {a} and {b} of the widest rows ({speeds[a]:,.0f} and {speeds[b]:,.0f} a second")


def record_cost(micro: int, speed: float, ratios: dict[int, float], rows: Callable[[int], dict],
                source: str) -> CallCost | None:
    """The cost of one of the run's micro batches where the probe timed only `micro` (at `speed`, the widest rows)
    and measuring another size was not worth it: the next smaller size the machine class's record measured (else
    the next larger) at `ratios[size]` times `speed`, as the record has it, and the line through the two. An auto
    run on a 2-core Intel Xeon (SmolLM2-135M LoRA, fp32) timed micro 4 only, at 371 positions a second of the
    widest rows, and trained at 320 over Bitext's narrower rows; the record's micro 1 at 0.56x micro 4 gives
    361 ms a micro batch + 1.99 ms a position, 318 a second over those rows (2026-12-03, a compare from an empty
    cache)."""
    other = max((s for s in ratios if s < micro), default=min((s for s in ratios if s > micro), default=None))
    if other is None:
        return None
    said = {micro: speed, other: speed * ratios[other]}
    return _line([_point(rows(size), said[size]) for size in (micro, other)],
                 f"at micro {micro} of the widest rows, with micro {other} at {ratios[other]:.2f}x it as the record "
                 f"of {source} has it ({speed:,.0f} and {said[other]:,.0f} a second")


def width_cost(micro: int, wide, wide_speed: float, narrow, narrow_speed: float) -> CallCost:
    """The cost of one of the run's micro batches from probes at `micro` of the widest rows (collated `wide`) and of
    rows about as wide as the run's (`narrow`), where no second size was measured (a micro batch asked for). Where
    no line fits the two (the narrow rows took as long as the widest, or were cheaper a position: the probes' noise
    is larger than what a micro batch pays whatever its width), both measured the same cost a position, and it is
    their positions over their seconds: in four such plans of the README's compare on a 2-core Xeon the pooled
    figure missed the run by 2-9%, the narrow probe's alone by 3-18% (2026-12-04)."""
    width = narrow["input_ids"].shape[-1]
    probes = (f"at micro {micro} of the widest rows and of rows {width} wide ({wide_speed:,.0f} and "
              f"{narrow_speed:,.0f} a second")
    points = [_point(wide, wide_speed), _point(narrow, narrow_speed)]
    return _line(points, probes) or CallCost(0.0, sum(t for _, t in points) / sum(p for p, _ in points),
                                             probes + "; no line fits the two, so their positions over their time")


def with_optimizer(probe_speed: float, work: Work, steps: int, optimizer_s: float,
                   calls: CallCost | None = None) -> tuple[float, str]:
    """The positions a second the run's steps should train at: the probe's forward and backward (at the widest
    rows; with `calls`, each of the run's micro batches at its own width, a cost per micro batch and per position)
    and one optimizer step (`optimizer_s`, timed by `optimizer_step_s`) per optimizer step, with the text that says
    so. The probe times no optimizer step: a full fine-tune of SmolLM2-135M spent 0.14-0.25 s a step in it on a
    2-core AVX2 EPYC (timed here), about 1% of its ~23 s steps; LoRA's is about a millisecond."""
    per_step = work.positions / steps  # this rank's positions an optimizer step
    optimizer = f" and an optimizer step ({1000 * optimizer_s:,.0f} ms)"
    if calls is None or not work.micro_batches:
        speed = per_step / (per_step / probe_speed + optimizer_s)
        return speed, f"the probe's forward and backward at the widest rows ({probe_speed:,.0f} a second){optimizer}"
    forward_backward = work.micro_batches * calls.fixed_s + work.positions * calls.per_position_s
    speed = work.positions / (forward_backward + steps * optimizer_s)
    fixed = f"{1000 * calls.fixed_s:,.0f} ms a micro batch whatever its width and " if calls.fixed_s else ""
    return speed, (f"the probe's forward and backward {calls.probes}: {fixed}"
                   f"{1000 * calls.per_position_s:,.2f} ms a position, over the run's "
                   f"{work.micro_batches:,.0f} of {work.positions / work.micro_batches:,.0f} positions on average)"
                   f"{optimizer}")


def optimizer_step_s(trainable: int, device) -> float:
    """Seconds of the run's optimizer step (torch's AdamW, as optim.adamw builds it) over `trainable` fp32
    parameters: timed on stand-in tensors of at most OPTIMIZER_SAMPLE elements, scaled by count (the step reads
    and writes each element a fixed number of times, so its time is linear in them once past the caches)."""
    n = max(1, min(trainable, OPTIMIZER_SAMPLE))
    p = torch.zeros(n, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], fused=optim.fused_adamw(device) or None)
    times = []
    for _ in range(3):  # the first allocates the moments
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times[1:]) * trainable / n


@dataclass(frozen=True)
class Forecast:
    """What the plan predicts of the training loop (this rank's work; tokens/s over all ranks)."""

    work: Work
    positions_per_s: float | None  # the steady speed: the last run's of this shape, or the probe's (corrected)
    first_steps_s: float  # extra seconds the first steps take beyond the steady speed
    peak_mb: float
    world_size: int = 1
    speed_from: str = "the probe"
    probe_positions_per_s: float | None = None  # what the probe measured, before any machine correction
    step_s: float | None = None  # where steps sample (GRPO): what the last run of this shape took a step
    steps: int = 0

    @property
    def train_s(self) -> float | None:
        if self.positions_per_s:
            return self.work.positions / self.positions_per_s + self.first_steps_s
        return self.steps * self.step_s if self.step_s and self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        if not self.positions_per_s or not self.work.positions:
            return None
        return self.positions_per_s * self.work.tokens / self.work.positions * self.world_size


@dataclass(frozen=True)
class StepTimes:
    """What the run's steps measured: the first steps (those that ran slow before the speed settled) and their time
    beyond the steady speed, and the steady speed itself over the steps after them (positions and real tokens a
    second)."""

    positions: float
    first_steps: int
    first_steps_s: float
    steady_positions_per_s: float | None
    steady_tokens_per_s: float | None


def split_steps(times: list[tuple[float, int, int]]) -> StepTimes:
    """Each step's (seconds, positions, real tokens) into the first steps (the leading steps up to the last one in
    the first half that took SLOW times what the later half's median speed gives it) and the steady speed over the
    steps after them."""
    rates = [p / s for s, p, _ in times if s > 0]
    later = rates[len(rates) // 2:]
    median = statistics.median(later) if later else None
    if not median:
        return StepTimes(sum(p for _, p, _ in times), 0, 0.0, None, None)
    slow = [i for i, (s, p, _) in enumerate(times) if i < max(1, len(times) // 2) and s > SLOW * p / median]
    first = slow[-1] + 1 if slow else 0
    steady, steady_tokens = _speeds(times[first:])
    first_s = sum(s - p / steady for s, p, _ in times[:first])
    return StepTimes(sum(p for _, p, _ in times), first, first_s, steady, steady_tokens)


def check(f: Forecast, times: list[tuple[float, int, int]], wall_s: float, peak_mb: float,
          fed: tuple[int, int, float] | None = None, sampled: bool = False, cores_shared: float | None = None) -> dict:
    """summary.json's `plan_check`: each figure predicted and measured, and the training time's difference by
    cause (data: other positions than planned; steady speed; first steps). `times` are this process's steps'
    (seconds, positions, all ranks' real tokens); `wall_s` the loop's (evaluations and checkpoints in it).
    `fed`: the largest micro batch the loop fed (rows, width) and the memory plan's peak at it, when it held a
    tenth or more fewer positions than the plan's (GRPO leaves out groups that teach nothing): the plan is then
    a bound, and the peak is also held to the plan at what was fed. `sampled`: the steps also sample (GRPO, RFT),
    so a step's time follows what it drew, not its positions: no first steps are told apart from the rest, and
    the steady speed is the later half's. `cores_shared`: the share of the core time the loop needed that other
    processes or the host took (monitor.CoreShare; None off a CPU)."""
    s = StepTimes(sum(p for _, p, _ in times), 0, 0.0, *_speeds(times[len(times) // 2:])) if sampled else \
        split_steps(times)
    train_s = sum(t for t, _, _ in times)
    out: dict = {
        "train_time_s": _pair(f.train_s, train_s),
        "steady_tokens_per_s": _pair(f.tokens_per_s, s.steady_tokens_per_s),
        "steady_positions_per_s": _pair(f.positions_per_s, s.steady_positions_per_s),
        "first_steps_s": _pair(f.first_steps_s if f.positions_per_s else None, s.first_steps_s),
        "first_steps": s.first_steps,
        "peak_memory_mb": _pair(f.peak_mb, peak_mb),
        "evaluations_and_checkpoints_s": round(max(wall_s - train_s, 0.0), 2),
        "speed_from": f.speed_from if f.positions_per_s or f.step_s else None,
        "seconds_a_step": _pair(f.step_s, steady_step_s(times)),
        "cores_shared": cores_shared,
    }
    if fed is not None:
        out["peak_memory_as_fed_mb"] = _pair(fed[2], peak_mb)
        out["largest_micro_batch_fed"] = [fed[0], fed[1]]
    if f.positions_per_s and s.steady_positions_per_s:
        out["difference_s"] = {
            "data": round((s.positions - f.work.positions) / f.positions_per_s, 2),
            "steady speed": round(s.positions / s.steady_positions_per_s - s.positions / f.positions_per_s, 2),
            "first steps": round(s.first_steps_s - f.first_steps_s, 2),
        }
    return out


def _speeds(times: list[tuple[float, int, int]]) -> tuple[float | None, float | None]:
    """(positions, real tokens) a second over `times`."""
    seconds = sum(t for t, _, _ in times)
    if not seconds:
        return None, None
    return sum(p for _, p, _ in times) / seconds, sum(n for _, _, n in times) / seconds


def _pair(predicted: float | None, measured: float | None) -> dict:
    ratio = measured / predicted if predicted and measured is not None else None
    return {"predicted": None if predicted is None else round(predicted, 2),
            "measured": None if measured is None else round(measured, 2),
            "ratio": None if ratio is None else round(ratio, 3)}


def lines(c: dict) -> list[str]:
    """The closing lines that hold the plan against the run."""
    def fig(pair: dict, unit: str, fmt: str = "{:,.1f}") -> str:
        p, m, r = pair["predicted"], pair["measured"], pair["ratio"]
        text = f"predicted {fmt.format(p)}{unit}, measured {fmt.format(m)}{unit}" if p is not None else \
            f"not predicted, measured {fmt.format(m)}{unit}" if m is not None else "neither predicted nor measured"
        if r is not None:
            text += f" ({r:.2f}x" + (", missed by more than 15%)" if abs(r - 1) > MISSED else ")")
        return text

    out = ["plan against the run (the steps' time: measuring, evaluations and checkpoints apart):",
           f"  time to train      {fig(c['train_time_s'], ' s')}"]
    if "difference_s" in c:
        out[-1] += "; " + ", ".join(f"{k} {v:+.1f} s" for k, v in c["difference_s"].items())
    after = f" (steps {c['first_steps'] + 1} on)" if c["first_steps"] else ""
    out += [f"  steady tokens/s    {fig(c['steady_tokens_per_s'], '', '{:,.0f}')}{after}"
            + (f"; predicted from {c['speed_from']}" if c["speed_from"] else ""),
            f"  first steps' extra {fig(c['first_steps_s'], ' s')}"
            + (f" over the first {c['first_steps']} step(s)" if c["first_steps"] else ""),
            *([f"  seconds a step     {fig(c['seconds_a_step'], ' s', '{:,.2f}')} (the later half's median)"]
              if c.get("seconds_a_step", {}).get("predicted") is not None else []),
            f"  peak memory        {_memory(c, fig)}",
            f"  evaluations and checkpoints {c['evaluations_and_checkpoints_s']:,.1f} s beside the steps"]
    shared = c.get("cores_shared")
    if shared is not None and shared > SHARED_SAID:
        out.append(f"  cores shared       {100 * shared:.0f}% of the core time the steps needed went to other processes "
                   "or the host: " + (f"its speed is not kept as this shape's record (over {100 * SHARED:.0f}%)"
                                      if shared_too_much(c) else f"its speed is kept ({100 * SHARED:.0f}% or less)"))
    return out


def shared_too_much(c: dict) -> bool:
    """Whether others took so much of the run's cores (plan_check's `cores_shared`) that its speed teaches nothing."""
    return (c.get("cores_shared") or 0.0) > SHARED


def _memory(c: dict, fig: Callable) -> str:
    if "peak_memory_as_fed_mb" not in c:
        return fig(c["peak_memory_mb"], " MB", "{:,.0f}")
    (rows, width), bound = c["largest_micro_batch_fed"], c["peak_memory_mb"]
    return (f"the plan's {bound['predicted']:,.0f} MB is a bound (every row fed at its longest); at the largest "
            f"micro batch fed ({rows} rows x {width}) {fig(c['peak_memory_as_fed_mb'], ' MB', '{:,.0f}')}")


def steady_step_s(times: list[tuple[float, int, int]]) -> float | None:
    """The median seconds of the later half's steps: a step that samples (GRPO) varies with what it drew."""
    later = [t for t, _, _ in times[len(times) // 2:]]
    return statistics.median(later) if later else None


# -- what a run teaches the next run of its shape


def learned(key: Key | None) -> dict:
    """{micro batch: what the last run at it trained} for a measurement key (the batch probe's), from the cache."""
    if key is None:
        return {}
    hit = cached(key) or {}
    return {int(k): v for k, v in hit.get("micro", {}).items()}


def runs_of(record: dict) -> list[float]:
    """The steady positions/s a learned record (learned's, one micro batch's) holds: its last runs', or its one
    speed where a cache written before runs were kept holds only that; [] for none."""
    return record.get("runs") or ([record["positions_per_s"]] if record.get("positions_per_s") else [])


def spread(speeds: list[float]) -> str:
    """Speeds as a reason says them: one alone, or their range."""
    return f"{min(speeds):,.0f}-{max(speeds):,.0f}" if len(speeds) > 1 else f"{speeds[0]:,.0f}"


def learn(key: Key | None, micro: int, c: dict, warm: bool, probe: float | None = None) -> None:
    """Record what this run trained at `micro` under `key`, so the next run of this shape predicts from it, with
    what its process's probe measured at `micro` (None where it did not run that size), the machine's speed then."""
    speed = c["steady_positions_per_s"]["measured"]
    if key is None or not speed:
        return
    hit = cached(key) or {}
    by_micro = dict(hit.get("micro", {}))
    before = by_micro.get(str(micro), {})
    runs = [*runs_of(before), speed]
    probes = [*before.get("probes", []), probe][-len(runs):]  # one a run, None where that run's process ran none
    by_micro[str(micro)] = {"positions_per_s": speed, "runs": runs[-RATIOS:], "probes": probes[-RATIOS:],
                            "first_steps_s": c["first_steps_s"]["measured"],
                            "predicted_positions_per_s": c["steady_positions_per_s"]["predicted"],
                            "speed_from": c["speed_from"], "warm": warm}
    store(key, {"micro": by_micro})


MACHINE = ("where", "precision", "torch", "method")  # what a machine's records of every shape are kept by


def machine_key(batch_key: Key) -> Key:
    """The key of what runs of this method on this machine (CPU or GPU, threads, precision, torch) trained against
    their probes: a LoRA step's optimizer is nothing, a full fine-tune's is not in the probe. Against the figure
    `with_optimizer` gives, a micro batch's cost at its own width in it (from two probes, or since 2026-12-04 from
    one and the class record's ratio of another): a record named for the figure before that (its ratios against
    the widest rows' speed alone) would correct the new figure for what it now counts."""
    return batch_key.narrowed("probe+calls+record+optimizer-to-run", MACHINE)


class Ratio(NamedTuple):
    """What runs on this machine trained at over what their probes measured: the factor a plan corrects by (the
    median of those within MISSED of the median of all; None where fewer than two, or no majority, agree so), how
    many agree (all of them where none corrects), the lowest and the highest, and the micro batch they were taken at
    (None: pooled over every size)."""

    factor: float | None
    agree: int
    low: float
    high: float
    micro: int | None = None

    def runs(self) -> str:
        return f"the last {self.agree} run(s)" + (f" at micro {self.micro}" if self.micro else "")


def _agreeing(ratios: list[float], micro: int | None) -> Ratio:
    middle = statistics.median(ratios)
    agree = [r for r in ratios if abs(r / middle - 1) <= MISSED]
    factor = statistics.median(agree) if len(agree) >= 2 and 2 * len(agree) > len(ratios) else None
    return Ratio(factor, len(agree) if factor else len(ratios), min(ratios), max(ratios), micro)


def probe_ratio(key: Key | None, micro: int | None = None) -> Ratio | None:
    """What the last runs on this machine trained at over what their probes measured (`Ratio`): those at `micro`
    where two or more of them agree, else those at every size; None before any run here was predicted from its
    probe. One run's ratio corrects nothing: a first process's probe on a new AVX512-BF16 VM measured 388
    positions/s where the run trained at 660 and later probes of the same shape 645 (2026-12-02), and a ratio of 1.70
    from it sent the next shapes' plans 1.5-2.4x short. By micro batch first: on a 2-core Intel Xeon (AVX512-BF16,
    fp32) nine compares' runs trained at 0.70-1.05x their probes at micro 1 (median 0.89) and 0.86-1.21x at micro
    4 (median 1.07), and one factor pooled over both corrected each the wrong way (2026-12-03)."""
    if key is None:
        return None
    record = cached(key) or {}
    at_micro = record.get("by_micro", {}).get(str(micro), []) if micro else []
    if at_micro:
        mine = _agreeing(at_micro, micro)
        if mine.factor is not None:
            return mine
    ratios = record.get("ratios", [])
    return _agreeing(ratios, None) if ratios else None


def learn_ratio(key: Key | None, c: dict, probe_speed: float | None, micro: int | None = None) -> None:
    """Keep what this run trained at over what its probe measured: the last RATIOS of this machine's runs, and the
    last RATIOS at the run's micro batch."""
    measured = c["steady_positions_per_s"]["measured"]
    if key is None or not measured or not probe_speed:
        return
    record = cached(key) or {}
    ratio = round(measured / probe_speed, 4)
    entry = {"ratios": [*record.get("ratios", []), ratio][-RATIOS:]}
    if micro:
        by_micro = dict(record.get("by_micro", {}))
        by_micro[str(micro)] = [*by_micro.get(str(micro), []), ratio][-RATIOS:]
        entry["by_micro"] = by_micro
    store(key, entry)


def memory_key(batch_key: Key) -> Key:
    """The key of what runs on this machine (CPU or GPU, precision, torch, method, quantization) held beyond their
    memory plans. Named for what the plan counts: since 2026-12-04 a step that samples is planned with its
    decoding's caches and its loss's log-probabilities, which figures kept against the plan before would count
    twice. By quantization: on an H200 an 8-bit base (bitsandbytes' int8 matmuls) peaked 1,042 MB beyond its plan,
    and the 4-bit run after it, one key with it then ("qlora"), was planned with that and peaked at 0.73x its plan
    (benchmarks/gpu-h200-2026-12-04). Named again on 2026-12-05: since the heap is handed back around each draw and
    the output head reads whole rows while decoding (2026-12-04), a sampled run holds 2-4 GB less, and a record from
    before planned the towns benchmark's GRPO arm at 7,118 MB for a peak of 4,597 (0.65x; benchmarks/README.md)."""
    return batch_key.narrowed("memory+trimmed-draws", (*MACHINE, "quantization"))


def memory_beyond(key: Key | None) -> tuple[float, int] | None:
    """(the median MB the last runs on this machine peaked above their plans, how many), or None before any."""
    beyond = (cached(key) or {}).get("beyond_mb", []) if key else []
    return (statistics.median(beyond), len(beyond)) if beyond else None


def learn_memory(key: Key | None, c: dict, learned_mb: float) -> None:
    """Keep what this run peaked above its plan without `learned_mb` (what it added from earlier runs), the last
    RATIOS runs'. Where the plan was a bound for more than the run fed (GRPO's untaught groups), above the plan at
    the largest micro batch it fed (plan_check's peak_memory_as_fed_mb): a GRPO run in bf16 on this Xeon peaked at
    1.19x and its next run at 1.25x that figure, sampling's caches and bf16's new shapes being no part of the plan,
    and learned nothing from it."""
    pair = c.get("peak_memory_as_fed_mb") or c["peak_memory_mb"]
    if key is None or pair["predicted"] is None or not pair["measured"]:
        return
    beyond = [*(cached(key) or {}).get("beyond_mb", []), round(pair["measured"] - pair["predicted"] + learned_mb, 1)]
    store(key, {"beyond_mb": beyond[-RATIOS:]})


def step_key(batch_key: Key) -> Key:
    """The key what runs whose steps sample (GRPO) took a step is kept under: the batch probe's, as a kind of its own."""
    return batch_key.as_kind("steps")


def learn_steps(key: Key | None, micro: int, c: dict) -> None:
    """Record what this run (its steps sample) took a step at `micro`, so the next run of its shape predicts from it."""
    step_s = c["seconds_a_step"]["measured"]
    if key is None or not step_s:
        return
    by_micro = dict((cached(key) or {}).get("micro", {}))
    by_micro[str(micro)] = {"step_s": step_s, "predicted_step_s": c["seconds_a_step"]["predicted"]}
    store(key, {"micro": by_micro})


def step_forecast(work: Work, micro: int, learned_: dict, steps: int, peak_mb: float, world_size: int) -> Forecast:
    """A run whose steps sample (no probe times that): its time from what the last run of this shape at `micro`
    took a step on this machine, or no time at all before one ran."""
    last = learned_.get(micro) or {}
    if not last.get("step_s"):
        return Forecast(work, None, 0.0, peak_mb, world_size, "nothing yet")
    source = f"what the last run at micro {micro} took a step on this machine, its sampling in it"
    said = last.get("predicted_step_s")
    if said and abs(last["step_s"] / said - 1) > MISSED:
        source += f" (it was predicted {said:,.1f} s, {last['step_s'] / said:.2f}x off: corrected)"
    return Forecast(work, None, 0.0, peak_mb, world_size, source, step_s=last["step_s"], steps=steps)


def _drifted(speed: float, source: str, last: dict, probe_now: float | None) -> tuple[float, str]:
    """The runs' speed scaled by how much faster or slower the machine measures now than when they trained: this
    process's probe at the size against those runs' processes' probes (their median), where the two differ by more
    than MISSED. A VM measured ~1.4x faster in the evening than its morning runs, and every plan that predicted
    from those runs said 0.63-0.84x of what its run took (2026-12-02, AVX2). Only where two or more of those
    probes agree within MISSED: one probe's noise is not the machine's drift. A 2-core Intel Xeon's probes of one
    shape read 189-356 positions/s in processes minutes apart while its runs trained at 237-307, and scaling by a
    lone earlier probe sent three plans of six 1.20x, 0.65x and 1.26x off (time taken over planned) where the last
    run's speed alone held within 11% (2026-12-03)."""
    then = [p for p in last.get("probes", []) if p]
    if not probe_now or len(then) < 2 or max(then) / min(then) - 1 > MISSED:
        return speed, source
    drift = probe_now / statistics.median(then)
    if abs(drift - 1) <= MISSED:
        return speed, source
    return speed * drift, (f"{source} x {drift:.2f}: the probe measured {probe_now:,.0f} a second at this size now "
                           f"against {statistics.median(then):,.0f} when they trained")


def trained_key(batch_key: Key) -> Key:
    """The key what runs trained is kept under: the batch probe's, as a kind of its own."""
    return batch_key.as_kind("trained")


def forecast(work: Work, micro: int, probe_speed: float | None, learned_: dict, warm: bool,
             first_steps_on_record: float | None, steps_micro: int, peak_mb: float, world_size: int,
             ratio: Ratio | None = None,
             probe_from: str = "the probe's forward and backward at the widest rows") -> Forecast:
    """The plan's prediction for a run of `work` at micro batch `micro`: its steady speed from what the last runs at
    that size trained at on this machine (`learned_`: the median of the last five, one run's speed moving with a
    VM's drift by up to a quarter), else the probe's, times what runs on this machine trained at
    against their probes (`ratio`, probe_ratio's: the median of those that agree, and how many) where two agree;
    its first steps' extra from the last run, else none when a probe ran this size in this process (`warm`), else
    the class record's figure (in micro batches of it) over `steps_micro` micro batches."""
    last = learned_.get(micro)
    speed, source = probe_speed, probe_from
    if last and last.get("positions_per_s"):
        runs = runs_of(last)
        speed = statistics.median(runs)
        source = (f"what the last run at micro {micro} trained at on this machine" if len(runs) == 1 else
                  f"the median of what the last {len(runs)} runs at micro {micro} trained at on this machine "
                  f"({spread(runs)} a second)")
        speed, source = _drifted(speed, source, last, probe_speed if warm else None)
        said, trained = last.get("predicted_positions_per_s"), last["positions_per_s"]
        if said and abs(trained / said - 1) > MISSED:
            source += (f" (it was predicted {said:,.0f} a second, {trained / said:.2f}x off: corrected)"
                       if len(runs) == 1 else
                       f" (the last was predicted {said:,.0f} a second and trained {trained / said:.2f}x that)")
    elif probe_speed and ratio is not None and ratio.factor is not None:
        speed = probe_speed * ratio.factor
        source += (f" ({probe_speed:,.0f} a second) x {ratio.factor:.2f}, what {ratio.runs()} on this machine "
                   "trained at against their probes")
    elif probe_speed and ratio is not None:
        source += (f", not corrected: {ratio.runs()} on this machine trained at {ratio.low:.2f}-{ratio.high:.2f}x "
                   "their probes, too few or too far apart to correct by")
    first = 0.0
    if last is not None and last.get("first_steps_s") is not None and bool(last.get("warm")) == warm:
        first = last["first_steps_s"]
    elif not warm and first_steps_on_record and speed and steps_micro:
        first = first_steps_on_record * work.positions / steps_micro / speed
    return Forecast(work, speed, first, peak_mb, world_size, source)
