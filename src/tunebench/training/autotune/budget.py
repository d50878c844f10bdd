"""How long a run's measurements may take: a share of the training they decide.

Measuring a setting costs probe steps on the run's own model, and a probe step of a large model on a CPU takes
seconds: on 2 cores, choosing the attention kernel and the micro batch of a 1.07B Llama took 196 s before 96 s
of training. Each measurement is worth at most what it can win, and a choice between two kernels or two micro
batches wins a fraction of the run's training time, so the measurements share a budget of 10% of that time,
predicted from the fastest speed measured so far and the tokens the run will compute (never more than its
`--time-budget`, which ends it by then), with a floor of 20 s
(the whole measurement of a small model takes a few seconds, and is cached for the next run). The first
candidate of each decision is always measured: it is the speed the prediction needs. The attention kernel,
measured first, may use half of the budget. Compile, measured last, is measured only when what measuring it
took on this machine before (a first guess until then) fits in what is left. A candidate whose measurement would take the total past the
budget is not measured, its row says so, and a partial measurement is not cached, so a longer run of the same
shape measures the rest. `--measure full` measures everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

SHARE = 0.10  # of the run's predicted training time
FLOOR_S = 20.0  # measuring may always take this long
# The attention kernel, measured first, may use half: the micro batch measured after it moves a CPU's speed by up
# to 2x (SmolLM2 on 2 cores: 479 tokens/s at 1 row, 981 at 8), the kernel by 5-35% (656 to 890).
ATTENTION_PART = 0.5
T = TypeVar("T")


def run_seconds(run_tokens: float, tokens_per_s: float, cap_s: float | None) -> float:
    """The run's training time at `tokens_per_s`, at most its --time-budget (`cap_s`), which ends it by then."""
    return min(run_tokens / tokens_per_s, cap_s or float("inf"))


class Budget:
    """The seconds one run's measurements may still take, from the tokens it will train and the speeds seen."""

    def __init__(self, run_tokens: float, share: float = SHARE, floor_s: float = FLOOR_S,
                 clock: Callable[[], float] = time.perf_counter, cap_s: float | None = None):
        self.run_tokens, self.share, self.floor_s, self.clock = run_tokens, share, floor_s, clock
        # --time-budget: the run trains no longer than this. A GRPO arm of the towns benchmark (--time-budget 45m,
        # --max-steps 400) measured for 1,089 s of its 2,700 against a tenth of 400 steps' tokens (2026-12-02)
        self.cap_s = cap_s
        self.started = clock()
        self.fastest: float | None = None  # tokens/s, the fastest measured so far

    def saw(self, tokens_per_s: float | None) -> None:
        if tokens_per_s:
            self.fastest = max(self.fastest or 0.0, tokens_per_s)

    def training_s(self) -> float | None:
        """The run's training time at the fastest speed measured so far, at most its time budget."""
        if not self.fastest:
            return None
        return run_seconds(self.run_tokens, self.fastest, self.cap_s)

    def allowed_s(self) -> float:
        """A tenth of the training (counted as at most the time budget), never under the floor: a budget of
        seconds still measures what a small model's speed needs."""
        training = self.training_s()
        return float("inf") if training is None else max(self.floor_s, self.share * training)

    def timing(self, measure: Callable[[], T]) -> tuple[T, float]:
        """`measure()` and the seconds it took, on this budget's clock."""
        start = self.clock()
        value = measure()
        return value, self.clock() - start

    def affords(self, cost_s: float, part: float = 1.0) -> bool:
        """Whether a measurement of about `cost_s` seconds fits in what is left of `part` of the budget."""
        return self.clock() - self.started + cost_s <= part * self.allowed_s()

    def why_not(self, cost_s: float, part: float = 1.0) -> str:
        limit = f"{part:.0%} of the {self.allowed_s():.0f} s" if part < 1 else f"{self.allowed_s():.0f} s"
        capped = self.cap_s is not None and self.training_s() == self.cap_s
        return (f"not measured: ~{cost_s:.0f} s more would take measuring past {limit}, {self.share:.0%} of the "
                f"run's {'--time-budget' if capped else 'predicted'} {self.training_s():.0f} s of training; --measure "
                "full measures it")
