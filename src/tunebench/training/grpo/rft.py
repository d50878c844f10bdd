"""Rejection-sampling fine-tuning (`--objective rft`; settings.objectives.RFT): GRPO's draws, kept or not.

Each optimizer step samples num_generations completions (or episodes) of each of its prompts from the policy as
it trains, exactly as GRPO's step does (the same seeds, environments and rewards: training/grpo/__init__.py's
Completions, episodes.Episodes), keeps those whose weighted reward passes --min-reward (above 0 by default; a
completion identical to one already kept in its group adds nothing and is dropped), and trains on the kept ones
with the next-token loss over their policy tokens, the step's mean over kept tokens. That is expert iteration
(Anthony et al., 2017) or RAFT (Dong et al., 2023) run online, one round a step, as RAFT++ (Xiong et al., 2025),
which matched GRPO on math at 1.5-7B; on the towns benchmark a 135M model gained +7 points by RFT where nine GRPO
runs made one procedure the answer to every question (benchmarks/README.md).

With --kind-column the kept completions are weighted so each kind present among them carries the same share of
the step's loss (a kind the policy already solves must not drown the one it is learning); the weights sum to the
kept count, so a step of one kind is plain SFT. Under torchrun each rank weighs its own prompts' completions.

Written here rather than taken from TRL: TRL has no rejection-sampling trainer (its BestOfN is an inference
sampler); this reuses GRPO's one loop, draws and resume instead of a loop of rounds of its own.
"""

from __future__ import annotations

import torch

from tunebench.settings.objectives import RFT
from tunebench.training.grpo import Drawn, GRPOLoss
from tunebench.training.preference import token_logps


class Kept:
    """RFT's credit (grpo.Credit): each completion's weight, 0 where not kept; unkept rows leave the forward and
    their tokens the step's normaliser."""

    skip = "rows"

    def __init__(self, s: RFT):
        self.s = s

    def of(self, drawn: Drawn, weights: torch.Tensor, kind: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, weighted rewards (NaN where no reward scored it), zero-spread flags), each (completions,)."""
        scores, g = drawn.scores, self.s.num_generations
        total = (scores * weights).nansum(1)
        total[torch.isnan(scores).all(1)] = torch.nan
        kept, seen = [], set()
        for i, (reward, tokens) in enumerate(zip(total.tolist(), drawn.completions)):
            key = (i // g, tuple(tokens))  # the same completion twice in a group: kept once
            kept.append(reward == reward and self.s.kept(reward) and key not in seen)
            if kept[-1]:
                seen.add(key)
        weight = balanced(kept, kind)
        grouped = torch.nan_to_num(total, nan=0.0).view(-1, g)
        zero = (grouped.max(1).values == grouped.min(1).values).repeat_interleave(g)
        return weight, total, zero

    def per_token(self, drawn: Drawn) -> None:
        return None  # an episode's per-turn rewards sum to its reward, which decides whether it is kept

    def masks(self, drawn: Drawn, credit: torch.Tensor) -> list[list[int]]:
        """The policy's tokens of each kept completion; none of an unkept one (the step's mean is over kept tokens)."""
        masks = drawn.masks or [[1] * len(c) for c in drawn.completions]
        return [m if w else [0] * len(m) for m, w in zip(masks, credit.tolist())]


def balanced(kept: list[bool], kind: list[int]) -> torch.Tensor:
    """Each completion's weight: 0 where not kept; 1 each without kinds; with kinds, kept / (kinds among the kept x
    that kind's kept), so every kind kept carries the same share and the weights sum to the kept count."""
    if not kind:
        return torch.tensor([float(k) for k in kept])
    counts: dict[int, int] = {}
    for k, c in zip(kept, kind):
        if k:
            counts[c] = counts.get(c, 0) + 1
    n = sum(counts.values())
    return torch.tensor([n / (len(counts) * counts[c]) if k else 0.0 for k, c in zip(kept, kind)])


class RFTLoss(GRPOLoss):
    """The next-token loss of the kept completions (a objective.Objective): each token's -log p (the logits as they are,
    not divided by the sampling temperature: this is supervised learning) times its completion's weight, summed,
    over the step's kept tokens (times its completions, which the loop divides by). Its stats are GRPO's (the rewards of every sampled completion, the watch's), with
    frac_kept for the share of completions trained on."""

    def stat_finish(self, means: dict[str, float], units: float) -> dict[str, float]:
        means = super().stat_finish(means, units)
        means.pop("kl", None)  # no reference
        skipped = means.pop("frac_groups_skipped", None)
        if skipped is not None:
            means["frac_kept"] = 1.0 - skipped
        return means

    def forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        index = batch["loss_index"]
        row = index // (batch["input_ids"].shape[1] - 1)
        logp = token_logps(self.model, batch, index, self.autocast_dtype, 1.0)
        weight = batch["advantages"].to(logp.dtype)[row]
        totals = batch["totals"]  # (completions, kept tokens) of the whole step: the loop divides by completions
        loss = -(logp * weight).sum() * (totals[0] / totals[1].clamp(min=1)).to(logp.dtype)
        skipped = batch.get("skipped", torch.zeros((), device=logp.device)).to(logp.dtype).reshape(1)
        zero = torch.zeros(1, device=logp.device, dtype=logp.dtype)
        return loss, torch.cat([zero, batch["row_stats"].to(logp.dtype).sum(0), skipped])
