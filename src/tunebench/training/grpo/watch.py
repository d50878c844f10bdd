"""GRPO's collapse, seen as it happens: the policy's entropy at what it sampled, and per question kind (a column the
prompts carry, --kind-column) the training reward and the share of groups that taught anything, each a step stat
(metrics.jsonl, the run's report); and a one-line warning when a kind's groups stay alike below the run's best, or
the entropy falls far under where it started.

Why these: a GRPO run that makes one procedure the answer to every question shows it first as one kind's groups
all failing alike (at beta 0 they leave the update, and nothing pulls that kind back) and as the entropy of each
turn's first token falling (the choice of procedure is made there); "Echo Chamber" (Zhao et al., 2025) and RAGEN's
"Echo Trap" saw the same at 150M-1B. TRL logs `entropy` (its mean over the completion tokens, from the training
forward); here it is read from the sampling's logits (model/decoding.py's `entropies`), so every completion counts,
including those of groups left out of the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tunebench.core.errors import TunebenchError

# Each completion's mean entropy a sampled token and its turns' first tokens' (nats); count/entropy: the completions
# whose sampling recorded them (a prompt-learning adapter decodes through transformers' generate: none).
ENTROPY_STATS = ("entropy", "entropy/first_token", "count/entropy")
ENTROPY_PER = {"entropy": "count/entropy", "entropy/first_token": "count/entropy"}
MAX_KINDS = 16  # a column of more values is no kind (an id, a free text): each kind adds three stats a step
ALIKE_STEPS = 5  # steps in a row a kind's groups may all score alike below the run's best before the warning
ENTROPY_DROP = 0.25  # the warning when the entropy falls under this share of the first step's


@dataclass(frozen=True)
class Kinds:
    """The question kinds of a run's prompts: the distinct values of `column`, sorted, and each prompt's (its row's)."""

    column: str
    names: tuple[str, ...]
    of_row: tuple[int, ...]  # each prompt row's kind, an index into names

    @classmethod
    def of(cls, column: str | None, rows: list[dict]) -> Kinds | None:
        if not column:
            return None
        missing = sum(column not in r or r[column] is None for r in rows)
        if missing:
            raise TunebenchError(f"--kind-column {column}: {missing} of {len(rows)} prompt rows have no {column!r}; "
                                 "give a column every row carries (the benchmark's 'kind'), or drop the flag")
        names = tuple(sorted({str(r[column]) for r in rows}))
        if len(names) > MAX_KINDS:
            raise TunebenchError(f"--kind-column {column}: {len(names)} distinct values, more than {MAX_KINDS}: a "
                                 "kind groups many prompts (one town, two towns); give such a column, or drop the flag")
        where = {n: i for i, n in enumerate(names)}
        return cls(column, names, tuple(where[str(r[column])] for r in rows))

    def stat_names(self) -> tuple[str, ...]:
        return tuple(f"kinds/{n}/{what}" for n in self.names for what in ("reward", "informative", "count"))

    def stat_per(self) -> dict[str, str]:
        return {f"kinds/{n}/{what}": f"kinds/{n}/count" for n in self.names for what in ("reward", "informative")}


def stat_names(kinds: Kinds | None) -> tuple[str, ...]:
    """The step stats this module adds after the draws' own, in their columns' order."""
    return ENTROPY_STATS + (kinds.stat_names() if kinds else ())


def stat_per(kinds: Kinds | None) -> dict[str, str]:
    return ENTROPY_PER | (kinds.stat_per() if kinds else {})


def columns(entropy: torch.Tensor | None, kinds: Kinds | None, kind: list[int], reward: torch.Tensor,
            taught: torch.Tensor) -> torch.Tensor:
    """(completions, len(stat_names)) each completion's terms of the stats above: `entropy` (completions, 2: mean,
    first tokens') or None where nothing was recorded, `kind` each completion's kind, `reward` its weighted reward,
    `taught` 1 where its group taught anything."""
    n = reward.shape[0]
    measured = torch.zeros(n, 2) if entropy is None else torch.nan_to_num(entropy.float())
    out = [measured, torch.full((n, 1), float(entropy is not None))]
    for k in range(len(kinds.names) if kinds else 0):
        mine = torch.tensor([float(c == k) for c in kind])
        out.append(torch.stack([torch.nan_to_num(reward) * mine, taught.float() * mine, mine], 1))
    return torch.cat(out, 1)


@dataclass
class Watch:
    """The warnings, from each step's groups on this process (under torchrun, rank 0's share of the prompts): `say`
    prints on rank 0 and is a no-op elsewhere; `fix`, what the kinds' warning says the objective leaves (its
    `alike_fix`: the warning named `--beta 0.04` to RFT runs too, which have no such flag and refuse it)."""

    kinds: Kinds | None
    say: Callable[[str], None]
    fix: str  # the objective's own (GRPO's, RFT's alike_fix), never a default text that could name another's flag
    alike: dict[int, int] = field(default_factory=dict)  # kind -> steps in a row its groups were all alike below best
    best: float = float("-inf")  # the best weighted reward any completion has scored in the run
    first_entropy: float | None = None
    low: bool = False  # the entropy warning was given (again only once it has recovered)
    step: int = 0

    def see(self, kind: list[int], reward: torch.Tensor, taught: torch.Tensor, entropy: torch.Tensor | None,
            g: int) -> None:
        """One step's completions (`g` a group, consecutive): each one's kind, weighted reward, whether its group
        taught, and its entropies (mean, first tokens'), or None."""
        self.step += 1
        scored = torch.nan_to_num(reward, nan=float("-inf"))
        self.best = max(self.best, float(scored.max())) if len(scored) else self.best
        if self.kinds is not None:
            self._kinds(kind, scored, taught, g)
        if entropy is not None and len(entropy):
            self._entropy(float(entropy[:, 0].mean()), float(entropy[:, 1].mean()))

    def _kinds(self, kind: list[int], scored: torch.Tensor, taught: torch.Tensor, g: int) -> None:
        groups: dict[int, list[bool]] = {}  # kind -> per group: alike below the run's best
        for start in range(0, len(kind), g):
            below = bool(scored[start:start + g].max() < self.best)
            groups.setdefault(kind[start], []).append(not bool(taught[start]) and below)
        for k, flags in groups.items():
            self.alike[k] = self.alike.get(k, 0) + 1 if all(flags) else 0
            if self.alike[k] == ALIKE_STEPS:
                self.say(f"warning: kind {self.kinds.names[k]!r} ({self.kinds.column}): its groups have scored alike "
                         f"below the run's best ({self.best:g}) for {ALIKE_STEPS} steps in a row, so they teach "
                         f"nothing; {self.fix}")

    def _entropy(self, mean: float, first: float) -> None:
        if self.first_entropy is None:
            self.first_entropy = mean
            return
        if not self.low and mean < ENTROPY_DROP * self.first_entropy:
            self.low = True
            self.say(f"warning: the sampled tokens' entropy fell to {mean:.3f} nats a token ({first:.3f} at each "
                     f"turn's first), under {ENTROPY_DROP:.0%} of step 1's {self.first_entropy:.3f}: the policy is "
                     "collapsing onto one way of answering")
        elif self.low and mean >= ENTROPY_DROP * self.first_entropy:
            self.low = False
