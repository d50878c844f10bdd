"""GRPO (Shao et al., 2024; DeepSeek-R1's method) inside tunebench's one training loop.

A unit is a prompt. For each optimizer step the policy samples `num_generations` completions of every prompt of
the step at once (its own weights, no copy; model/decoding.py's loop with the KV cache; the run's precision and
autocast), each completion is
scored by the rewards (training/grpo/rewards.py), and each one's advantage is its weighted reward against its group's:
(r - mean) / (std + 1e-4) with TRL's scale_rewards="group" (std with Bessel's correction), r - mean with "none".
The step's micro batches then train on (prompt + completion) rows, the loss on the completion tokens:

    per token: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL * ratio,
    KL = exp(ref - logp) - (ref - logp) - 1 (the k3 estimator), ratio = exp(logp - logp_old)

with one update per generation by default (TRL's num_iterations=1), so logp_old is logp without its gradient and
the ratio is 1 in value; with --num-iterations mu each draw trains mu steps in a row, logp_old its log-probabilities
at the policy that drew it (a forward pass without gradients at its first update, TRL's way), so the ratio moves
and epsilon clips it; log-probabilities are of the logits divided by the sampling temperature, as TRL scores them. The reference (only when beta > 0) is the model with the adapter's starting values put back for its pass (as
DPO's: preference.StartingAdapter), or a frozen copy under full fine-tuning. TRL's loss normalisations: "dapo" (its default: the step's completion tokens), "grpo" (each
completion's mean over its tokens, then the mean over the step's completions), "dr_grpo" (the step's
completions x max_completion_length). All three are sums over the step divided by a count of the whole step, so
the micro batch never changes the math; and the sampling is seeded by (seed, epoch, step) and made for the whole
step whatever its micro batches, so the completions a step learns from depend on neither the micro batch nor a
resume (exact resume needs no sampler state beyond the checkpoint's). Under torchrun each rank makes the groups of
its own prompts of the step (training/grpo/steps.py), seeded by its rank as well; the loop sums the step's counts over
the ranks, so the normalisations above are the whole step's.

Written here rather than taken from TRL: TRL's GRPOTrainer is a Trainer subclass with its own loop and
generation; tests/golden/make_grpo_golden.py checks losses, advantages, rewards and KL against it step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tunebench.data.batching import pad_examples
from tunebench.data.prompts import PromptData, PromptRows
from tunebench.model import decoding
from tunebench.model.inference import Placed
from tunebench.settings.objectives import GRPO
from tunebench.training.grpo import rewards as rewards_
from tunebench.training.grpo import watch as watch_
from tunebench.training.objective import Batch
from tunebench.training.preference import reference_logps, token_logps

# Why an episode ends: the built-in stop rules (training/grpo/episodes.py's Stops, a method each), in the order the
# step's stats list them; an environment's own rules (its STOPS) follow.
EPISODE_STOPS = ("answered", "cut", "max_turns", "no_room")


def episode_stats(stops: tuple[str, ...] = EPISODE_STOPS) -> tuple[str, ...]:
    """An episode's own figures, after the rewards': turns and calls a mean per episode, the calls that ran without
    error a share of the calls, then the share of episodes that ended by each stop rule of `stops`."""
    return ("episodes/turns", "episodes/calls", "episodes/calls_ok", *(f"episodes/stop/{why}" for why in stops))

EPISODE_STAT_PER = {"episodes/calls_ok": "episodes/calls"}
# A step's sampling time by part: the prompts' and contexts' prefills, the decoding of new tokens, an episode's
# tools (its calls and the tool turns rendered), the rewards' scoring (summary.json's sampling_split_s).
SPLIT = ("prefill", "decode", "tools", "scoring")


def stat_names(rewards: list[rewards_.Reward]) -> tuple[str, ...]:
    """What each step logs (TRL's names), summed over completions; `count/<name>` counts the completions a
    reward scored (a user's function may return None), reward_sq gives reward_std (see finish)."""
    per = [n for r in rewards for n in (f"rewards/{r.name}/mean", f"count/{r.name}")]
    return ("kl", "reward", "reward_sq", "frac_reward_zero_std", "completions/mean_length",
            "completions/clipped_ratio", *per)


def advantages(scores: torch.Tensor, weights: torch.Tensor, group: int, scale: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, weighted rewards, zero-spread flags), each (completions,), from `scores` (completions,
    rewards), NaN where a reward had no opinion. A completion no reward scored has advantage 0 and is left out of
    its group's mean (TRL's unscorable rows)."""
    unscorable = torch.isnan(scores).all(1)
    total = (scores * weights).nansum(1)
    total[unscorable] = torch.nan
    grouped = total.view(-1, group)
    mean = torch.nanmean(grouped, 1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, 1, keepdim=True) * count / (count - 1)  # Bessel's, as TRL
    std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, torch.nan)).expand_as(grouped).reshape(-1)
    adv = total - mean.expand_as(grouped).reshape(-1)
    if scale == "group":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), total, torch.isclose(std, torch.zeros_like(std))


def complete(model, tokenizer, device: torch.device, autocast, prompts: list[list[int]], max_new_tokens: int
             ) -> list[list[int]]:
    """One greedy completion of each prompt, decoded as one left-padded batch with the KV cache under
    inference.Placed (the run's precision and autocast), each cut after its EOS: the held-out reward's."""
    placed = Placed(model, tokenizer, device, autocast)
    ids, mask = decoding.left_padded(prompts, tokenizer.pad_token_id, device)
    return cut_after_eos(placed.decode(ids, mask, max_new_tokens), tokenizer.eos_token_id)


def cut_after_eos(new: torch.Tensor, eos: int) -> list[list[int]]:
    """Each decoded row (padding after its EOS) as its tokens up to and including its EOS."""
    return [row[:row.index(eos) + 1] if eos in row else row for row in new.tolist()]


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The seed of one rank's draws in optimizer step `step` of `epoch`: the same whatever the micro batch and
    after a resume; rank 0's as one process's."""
    return int(np.random.SeedSequence([seed, epoch, step, *([rank] if rank else [])]).generate_state(1)[0])


@dataclass
class Drawn:
    """What one step drew for its prompts, before the advantages: completions (or episodes' tokens after their
    opening), each one's reward scores and the figures its stats add."""

    completions: list[list[int]]  # num_generations per prompt, consecutive
    scores: torch.Tensor  # (completions, rewards), NaN where a reward had no opinion
    lengths: torch.Tensor  # (completions,) the policy's tokens
    clipped: torch.Tensor  # (completions,) 1 where cut at max_completion_length
    masks: list[list[int]] | None = None  # an episode's: 1 on the policy's tokens
    figures: torch.Tensor | None = None  # (completions, more stats): an episode's turns, calls, its stop
    # per-turn rewards (an environment's reward returned a list): each episode's {turn: weighted reward}, and the
    # turn each of its completion tokens belongs to; None where every reward is the episode's
    turn_rewards: list[dict[int, float]] | None = None
    turn_of: list[list[int]] | None = None
    # (completions, 2) each one's mean entropy a sampled token and its turns' first tokens' (watch.py), None where
    # the sampling recorded none
    entropy: torch.Tensor | None = None
    # --turn-credit state: each episode's state at the start of each of its turns (a digest of its context then)
    turn_states: list[list[bytes]] | None = None


@dataclass
class Groups:
    """One step's prompts, their completions and what each completion carries into the loss."""

    keys: list[int]  # the prompts (PromptData indices), in step order
    completions: list[list[int]]  # num_generations per prompt, consecutive
    advantages: torch.Tensor  # (completions,)
    row_stats: torch.Tensor  # (completions, len(stat_names) - 1): the per-completion terms of every stat but kl
    masks: list[list[int]] | None = None  # an episode's: 1 on the policy's tokens (None: every completion token)
    token_advantages: list[list[float]] | None = None  # per completion token, with per-turn rewards (turn_advantages)
    # --num-iterations above 1: each micro batch's log-probabilities at the policy that drew it (by its prompts),
    # what its later updates' ratios are against
    old_logps: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def scale(self, factor: torch.Tensor) -> None:
        """Each completion's credit (its advantage, and its tokens' where per turn) times its `factor`."""
        self.advantages = self.advantages * factor.to(self.advantages.dtype)
        if self.token_advantages is not None:
            self.token_advantages = [[a * f for a in row] for row, f in zip(self.token_advantages, factor.tolist())]

    def silent(self, i: int, g: int) -> bool:
        """Whether completion i's group (of `g`) teaches nothing: every advantage of every one of its tokens is 0."""
        group = range(i - i % g, i - i % g + g)
        if self.token_advantages is not None:
            return not any(a for j in group for a in self.token_advantages[j])
        return not self.advantages[group.start:group.stop].any()


@dataclass
class Sampling:
    """What a step's draws are made with (the policy as it trains, its prompts and rewards, the run's precision), and
    what drawing took: shared by both kinds of draws (Completions here, episodes.Episodes)."""

    model: Any
    tokenizer: Any
    data: PromptData
    rows: PromptRows
    rewards: list[rewards_.Reward]
    s: GRPO
    device: torch.device
    autocast: Any = None
    eagerly: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # sampling runs uncompiled
    generated_tokens: int = 0
    generation_s: float = 0.0
    prefilled: int = 0  # context tokens fed to the model while sampling (a group's prompt once)
    refills: list[int] = field(default_factory=lambda: [0, 0])  # groups drawn again (refill), of them turned informative
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPLIT, 0.0))  # seconds by part (SPLIT)

    def placed(self) -> Placed:
        """The policy put to work as it trains (inference.Placed): its precision and autocast."""
        return Placed(self.model, self.tokenizer, self.device, self.autocast)

    def took(self, seconds: float, prefill: float, tools: float = 0.0) -> None:
        """A draw's sampling time (its scoring aside), split: prefill, tools, and decode the rest."""
        self.generation_s += seconds
        for part, s in (("prefill", prefill), ("tools", tools), ("decode", seconds - prefill - tools)):
            self.times[part] += s


def refill(draws: Draws, drawn: Drawn, keys: list[int], seed: int) -> Drawn:
    """DAPO's dynamic sampling (Yu et al., 2025), for a step's own prompts: a group whose completions all scored
    alike (the same weighted reward, or none scored) teaches nothing at beta 0, so its prompt is drawn again, up to
    `rounds` times (each round's seed the step's and the round's: a resume draws the same), and the first fresh
    group that is not alike takes its place. The step keeps its prompts (so their kinds), and gets more groups that
    teach; each round costs a draw of the alike prompts only. Counted in draws.on.refills (drawn again, replaced).
    `rounds` is --resample-alike (GRPO's; 0, the default, and RFT: `drawn` as it is)."""
    g, rounds = draws.on.s.num_generations, getattr(draws.on.s, "resample_alike", 0)
    for round_ in range(1, rounds + 1):
        alike = [i for i in range(len(keys)) if _alike(drawn.scores[i * g:(i + 1) * g], draws.weights)]
        if not alike:
            break
        fresh = draws.draw([keys[i] for i in alike], int(np.random.SeedSequence([seed, round_]).generate_state(1)[0]))
        draws.on.refills[0] += len(alike)
        for j, i in enumerate(alike):
            if not _alike(fresh.scores[j * g:(j + 1) * g], draws.weights) and \
                    _splice(drawn, range(i * g, (i + 1) * g), fresh, range(j * g, (j + 1) * g)):
                draws.on.refills[1] += 1
    return drawn


def _alike(scores: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether a group's completions (their scores rows) all have the same weighted reward, or none was scored."""
    total = (scores * weights).nansum(1)[~torch.isnan(scores).all(1)]
    return len(total) < 2 or bool(torch.isclose(total, total[0]).all())


def _splice(drawn: Drawn, at: range, fresh: Drawn, of: range) -> bool:
    """`fresh`'s completions `of` put in `drawn`'s places `at`, every per-completion field of Drawn; False (nothing
    put) where the two draws do not carry the same fields (one with per-turn rewards, the other without)."""
    fields = [f.name for f in dataclasses.fields(Drawn)]
    if any((getattr(drawn, n) is None) != (getattr(fresh, n) is None) for n in fields):
        return False
    for n in fields:
        if getattr(drawn, n) is not None:
            getattr(drawn, n)[at.start:at.stop] = getattr(fresh, n)[of.start:of.stop]
    return True


class Draws(Protocol):
    """Where a step's completions come from, what the job, the loss and the held-out reward read of it: Completions
    (one sampled reply a completion) or episodes.Episodes (an episode of turns in an environment a completion). A
    draw is three stages, which a step (grpo/steps.py's DrawnSteps) takes in order: `seeded` (the draw's randomness
    seeded by its seed alone, and its sampling timed), `play` (the policy samples: one batched decode, or episodes
    played turn by turn) and `scored` (the rewards, the sampling's figures, a Drawn); `draw` is the three at once."""

    on: Sampling
    episode_stats: tuple[str, ...]  # an episode's figures (episode_stats), which follow the rewards'; () for replies
    weights: torch.Tensor  # (rewards,) each scores column's weight in the reward

    def seeded(self, seed: int) -> contextlib.AbstractContextManager: ...
    def play(self, keys: list[int]) -> Any: ...
    def scored(self, keys: list[int], played: Any) -> Drawn: ...
    def draw(self, keys: list[int], seed: int) -> Drawn: ...
    def reward_names(self) -> list[rewards_.Reward]: ...
    def stat_names(self) -> tuple[str, ...]: ...
    def probe_length(self, keys: list[int]) -> int: ...
    def held_out_scores(self, chunks: list[list[int]]) -> list[list[float]]: ...
    def held_out_figures(self, rows: list[list[float]]) -> dict[str, float]: ...


class Drawing:
    """`draw`, as both kinds of draws make it from their stages (Draws)."""

    def draw(self, keys: list[int], seed: int) -> Drawn:
        """`keys`' groups drawn with `seed`: seeded, played, scored."""
        with self.seeded(seed):
            played = self.play(keys)
        return self.scored(keys, played)


class Completions(Drawing):
    """Single-turn draws: num_generations completions of each prompt sampled in one batched decode (`play`), each
    scored by the --reward functions on its text (`scored`)."""

    episode_stats: tuple[str, ...] = ()

    def __init__(self, on: Sampling):
        self.on = on
        self.weights = torch.tensor([r.weight for r in on.rewards], dtype=torch.float32)

    def reward_names(self) -> list[rewards_.Reward]:
        """The rewards the step's stats name, in their columns' order."""
        return self.on.rewards

    def stat_names(self) -> tuple[str, ...]:
        return stat_names(self.on.rewards)

    def probe_length(self, keys: list[int]) -> int:
        """The longest completion a row of `keys` can hold: what the probe's rows are made of."""
        return self.on.s.max_completion_length

    def texts(self, keys: list[int], completions: list[list[int]], g: int
              ) -> tuple[list[str], list[str], dict[str, list]]:
        """(prompts, completions, columns) as the rewards read them, one item a completion (`g` a prompt): each
        prompt the text the model was given, in the run's prompt format."""
        on = self.on
        rendered = {k: on.tokenizer.decode(on.data.ids[k]) for k in keys}
        sources = [on.data.source(k) for k in keys for _ in range(g)]
        prompts = [rendered[k] for k in keys for _ in range(g)]
        texts = [on.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        names = on.rows.column_names()
        return prompts, texts, {n: [on.rows.columns[i].get(n) for i in sources] for n in names}

    def score(self, keys: list[int], completions: list[list[int]], g: int) -> torch.Tensor:
        """(completions, rewards) each reward's score, NaN where it returned None (`g` completions a prompt)."""
        prompts, texts, columns = self.texts(keys, completions, g)
        scores = [[torch.nan if v is None else v for v in r.score(prompts, texts, columns)] for r in self.on.rewards]
        return torch.tensor(scores, dtype=torch.float32).T.reshape(len(completions), len(self.on.rewards))

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """The draw's random draws seeded by `seed` alone (torch's generator, put back after), its sampling timed."""
        on = self.on
        started, prefill = time.perf_counter(), decoding.PREFILL_S[0]
        with torch.random.fork_rng(devices=[on.device] if on.device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield
        on.took(time.perf_counter() - started, decoding.PREFILL_S[0] - prefill)

    def play(self, keys: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """num_generations completions of each prompt of `keys` sampled from the policy in one batched decode (each
        prompt prefilled once for its group; top_k off, temperature and top_p as set), each up to and including
        its EOS; with each one's entropy figures (watch.py), None where the sampling recorded none."""
        on, s = self.on, self.on.s
        placed, eos = on.placed(), on.tokenizer.eos_token_id
        ids, mask = decoding.left_padded([on.data.ids[k] for k in keys], on.tokenizer.pad_token_id, on.device)
        with on.eagerly(), decoding.entropies() as recorded, placed.running() as model:
            new = decoding.decode(model, ids, mask, s.max_completion_length, eos, placed.pad_id(), s.temperature,
                                  s.top_p, repeat=s.num_generations)
        entropy = None
        if recorded:  # one decode: (summed, counted, first) over the completions in order
            summed, counted, first = recorded[0]
            entropy = torch.stack([summed / counted.clamp(min=1), first], 1).cpu()
        return cut_after_eos(new, eos), entropy

    def scored(self, keys: list[int], played: tuple[list[list[int]], torch.Tensor | None]) -> Drawn:
        """`play`'s completions of `keys` scored by the --reward functions, counted in the sampling's figures."""
        (completions, entropy), on = played, self.on
        on.generated_tokens += sum(map(len, completions))
        on.prefilled += sum(len(on.data.ids[k]) for k in keys)
        eos = on.tokenizer.eos_token_id
        started = time.perf_counter()
        scores = self.score(keys, completions, on.s.num_generations)
        on.times["scoring"] += time.perf_counter() - started
        return Drawn(completions, scores,
                     torch.tensor([len(c) for c in completions], dtype=torch.float32),
                     torch.tensor([float(not c or c[-1] != eos) for c in completions]), entropy=entropy)

    def held_out_scores(self, chunks: list[list[int]]) -> list[list[float]]:
        """Each held-out prompt's row of reward scores (NaN where a reward had no opinion) for one greedy completion,
        `chunks` (lists of held-out prompts) decoded as one batch each."""
        on, rows = self.on, []
        for chunk in chunks:
            with on.eagerly():
                completions = complete(on.model, on.tokenizer, on.device, on.autocast,
                                       [on.data.ids[k] for k in chunk], on.s.max_completion_length)
            rows += self.score(chunk, completions, 1).tolist()
        return rows

    def held_out_figures(self, rows: list[list[float]]) -> dict[str, float]:
        """The weighted reward of held_out_scores' rows (all ranks' together), and each reward's."""
        rewards = self.on.rewards
        scores = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(rewards))
        return {"eval_reward": float((scores * self.weights).nansum(1).mean()),
                **{f"eval_rewards/{r.name}/mean": float(torch.nanmean(scores[:, j])) for j, r in enumerate(rewards)}}


class Credit(Protocol):
    """What each completion of a step carries into the loss: GRPO's advantage (Advantages) or RFT's weight where
    kept (rft.Kept); `skip` names what rows_of leaves out of the forward ("groups", "rows" or "")."""

    skip: str

    def of(self, drawn: Drawn, weights: torch.Tensor, kind: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def per_token(self, drawn: Drawn) -> list[list[float]] | None: ...
    def masks(self, drawn: Drawn, credit: torch.Tensor) -> list[list[int]] | None: ...


class Advantages:
    """GRPO's credit: each completion's advantage within its group (`advantages`), each token's where an episode's
    rewards come per turn (`turn_advantages`); at beta 0 a group that teaches nothing leaves the forward."""

    def __init__(self, s: GRPO):
        self.s, self.skip = s, "groups" if s.beta == 0 else ""

    def of(self, drawn: Drawn, weights: torch.Tensor, kind: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adv, total, zero = advantages(drawn.scores, weights, self.s.num_generations, self.s.scale_rewards)
        return torch.where(adv < 0, adv * self.s.negative_weight, adv), total, zero

    def per_token(self, drawn: Drawn) -> list[list[float]] | None:
        if drawn.turn_rewards is None:
            return None
        per_turn = state_advantages(drawn.turn_rewards, drawn.turn_states, self.s.num_generations,
                                    self.s.scale_rewards) if drawn.turn_states is not None else \
            turn_advantages(drawn.turn_rewards, self.s.num_generations, self.s.scale_rewards)
        w = self.s.negative_weight
        return [[(a[t] * w if a[t] < 0 else a[t]) if t < len(a) else 0.0 for t in turns]
                for a, turns in zip(per_turn, drawn.turn_of)]

    def masks(self, drawn: Drawn, credit: torch.Tensor) -> list[list[int]] | None:
        return drawn.masks  # every completion's tokens count in the step's normalisers, taught or not


def turn_advantages(rewards: list[dict[int, float]], group: int, scale: str) -> list[list[float]]:
    """Each episode's advantage at each of its turns from per-turn rewards, as the GRPO paper's process supervision
    (Shao et al., 2024, 4.1.3): every reward of a group's episodes normalized together, (r - mean) / (std + 1e-4)
    with scale "group" (std with Bessel's correction, as `advantages`), r - mean with "none"; a turn's advantage is
    the sum of the normalized rewards of that turn and the later ones (what followed from it), so a turn's reward
    is credited to its own tokens and to the turns that led to it, never to a later turn. An episode whose reward
    is one number has it at its last turn, so a group of such episodes gets `advantages`' figures."""
    out = []
    for start in range(0, len(rewards), group):
        episodes = rewards[start:start + group]
        pool = torch.tensor([r for e in episodes for r in e.values()], dtype=torch.float64)
        mean = pool.mean() if len(pool) else torch.tensor(0.0, dtype=torch.float64)
        std = pool.std() if len(pool) > 1 else torch.tensor(torch.nan, dtype=torch.float64)
        for e in episodes:
            norm = {t: float(torch.nan_to_num((r - mean) / (std + 1e-4) if scale == "group" else r - mean))
                    for t, r in e.items()}
            out.append([sum(v for j, v in norm.items() if j >= t) for t in range(max(e, default=-1) + 1)])
    return out


def state_advantages(rewards: list[dict[int, float]], states: list[list[bytes]], group: int, scale: str
                     ) -> list[list[float]]:
    """Each episode's advantage at each of its turns against the episodes of its group that reached the same
    state (GiGPO, Feng et al., 2025, with its weight of 1 on the step term): its episode's advantage (the sum of its
    rewards against the group's sums) plus its return from that turn (the sum of that turn's reward and the later
    ones') against the returns of the group's turns whose contexts were token-identical at their start (`states`);
    both normalized as `advantages` ((x - mean) / (std + 1e-4) with scale "group", x - mean with "none"), a state
    no other episode reached adding 0. Where `turn_advantages` charges every turn the pooled mean of a group's
    turn rewards (an episode that tries one more call and slips scores below one that answers at once, wrong),
    two actions taken from the same context are told apart by what followed from each alone. An episode no reward
    scored ({}) has 0 at every turn and is left out of every baseline."""
    out: list[list[float]] = []
    for start in range(0, len(rewards), group):
        episodes, at = rewards[start:start + group], states[start:start + group]
        scored = [i for i, e in enumerate(episodes) if e]
        total = _normalized({i: sum(episodes[i].values()) for i in scored}, scale)
        returns: dict[bytes, dict[tuple[int, int], float]] = {}
        for i in scored:
            for t, state in enumerate(at[i]):
                returns.setdefault(state, {})[i, t] = sum(r for j, r in episodes[i].items() if j >= t)
        step = {it: a for same in returns.values() if len(same) > 1 for it, a in _normalized(same, scale).items()}
        out += [[total[i] + step.get((i, t), 0.0) for t in range(len(at[i]))] if i in total else [0.0] * len(at[i])
                for i in range(len(episodes))]
    return out


def _normalized(values: dict, scale: str) -> dict:
    """`values` against their mean, divided by their std (Bessel's) + 1e-4 with scale "group"; 0 for one alone."""
    x = torch.tensor(list(values.values()), dtype=torch.float64)
    if len(x) < 2:
        return dict.fromkeys(values, 0.0)
    norm = (x - x.mean()) / (x.std() + 1e-4) if scale == "group" else x - x.mean()
    return dict(zip(values, norm.tolist()))


def rows_of(groups: Groups, keys: list[int], data: PromptData, g: int, pad_id: int, skip: str = "",
            multiple: int = 1, cap: int | None = None) -> Batch:
    """The (prompt + completion) rows of `keys`' groups, right-padded (to the longest, rounded up to `multiple`,
    never past `cap`: batching.pad_examples), the loss on the completion tokens (on an episode's, the policy's
    tokens of it: groups.masks).
    Besides the usual tensors: `advantages` (rows,), `row_stats` (completions, stats: every completion's, rows or
    not), `counts` (completions, completion tokens: the units this micro batch adds to its optimizer step's
    normalisers, objective.prepare) and `skipped` (completions left out).

    `skip` "groups" (GRPO at beta 0): a group whose advantages are all 0 teaches nothing (its loss and gradient are
    0 without a KL term), so its rows are left out of the forward and backward; it still counts in the normalisers
    and the stats, so the step's loss and gradients are the same. "rows" (RFT): every row of weight 0 (not kept) is
    left out. A micro batch of such rows alone keeps its first row (a weight of 0 again): every rank runs its
    forward and backward for the gradient sync."""
    where = {key: i for i, key in enumerate(groups.keys)}
    picked = [where[key] * g + j for key in keys for j in range(g)]
    masks = groups.masks or [[1] * len(c) for c in groups.completions]
    owners = [key for key in keys for _ in range(g)]
    # a completion of a group that teaches nothing (all its group's advantages are 0), or one of weight 0
    alike = [skip == "groups" and groups.silent(i, g) or skip == "rows" and not groups.advantages[i] for i in picked]
    rows = [(key, i) for key, i, out in zip(owners, picked, alike) if not out] or [(owners[0], picked[0])]
    examples = [(np.asarray(data.ids[key] + groups.completions[i]),
                 np.asarray([0] * len(data.ids[key]) + masks[i])) for key, i in rows]
    batch = pad_examples(examples, pad_id, multiple, cap)
    batch["advantages"] = groups.advantages[torch.tensor([i for _, i in rows])]
    if groups.token_advantages is not None:  # per-turn rewards: each completion token its own advantage
        grid = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for r, (key, i) in enumerate(rows):
            start = len(data.ids[key])
            grid[r, start:start + len(groups.completions[i])] = torch.tensor(groups.token_advantages[i])
        batch["token_advantages"] = grid[:, 1:].contiguous()  # aligned with the shifted targets (objective.prepare)
    batch["row_stats"] = groups.row_stats[torch.tensor(picked)]
    batch["counts"] = torch.tensor([len(picked), sum(sum(masks[i]) for i in picked)])
    batch["skipped"] = torch.tensor(float(sum(alike)))
    return batch


class GRPOLoss(torch.nn.Module):
    """The GRPO objective over `model` (module docstring), a objective.Objective: (loss sum, stat sums over
    completions)."""

    unit = "completions"

    def __init__(self, model, settings: GRPO, rewards: list[rewards_.Reward], autocast_dtype=None,
                 reference=None, episode_stats: tuple[str, ...] = (), kinds: watch_.Kinds | None = None):
        super().__init__()
        self.model, self.s, self.autocast_dtype = model, settings, autocast_dtype
        self.stat_names = (stat_names(rewards) + tuple(episode_stats) + watch_.stat_names(kinds)
                           + ("frac_groups_skipped",))  # StepRows.stat_names' order, then the skipped groups
        self.stat_per = {f"rewards/{r.name}/mean": f"count/{r.name}" for r in rewards} | (
            EPISODE_STAT_PER if episode_stats else {}) | watch_.stat_per(kinds)
        self._reference = [reference]  # a list: not a submodule, so neither trained nor wrapped by DDP

    def stat_finish(self, means: dict[str, float], units: float) -> dict[str, float]:
        """reward_std from the mean reward and mean squared reward (Bessel's correction, as TRL)."""
        square = means.pop("reward_sq", None)
        if square is not None and units > 1:
            means["reward_std"] = max(0.0, (square - means["reward"] ** 2) * units / (units - 1)) ** 0.5
        return means

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        index = batch["loss_index"]
        width = batch["input_ids"].shape[1] - 1
        rows = batch["input_ids"].shape[0]
        row = index // width
        # the reference first (see preference.reference_logps: it may write the adapter's starting values in place)
        ref = reference_logps(self.model, self._reference[0], batch, index, self.autocast_dtype, s.temperature) \
            if s.beta else None
        logp = token_logps(self.model, batch, index, self.autocast_dtype, s.temperature)
        adv = batch["token_advantages"].to(logp.dtype).reshape(-1)[index] if "token_advantages" in batch else \
            batch["advantages"].to(logp.dtype)[row]
        old = batch.get("old_logps")  # --num-iterations: the draw's; else this pass's own, a ratio of 1 in value
        ratio = torch.exp(logp - (logp.detach() if old is None else old.to(logp.dtype)))
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high) * adv)
        totals = batch["totals"]  # (completions, completion tokens) of the whole step
        per_completion_token = (totals[0] / totals[1]).to(logp.dtype)
        kl_sum = torch.zeros((), device=logp.device, dtype=logp.dtype)
        if s.beta:
            delta = ref - logp
            kl = torch.exp(delta) - delta - 1
            # times the ratio, 1 in value: the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default,
            # use_bias_correction_kl=True)
            per_token = per_token + s.beta * kl * ratio
            kl_sum = kl.detach().sum() * per_completion_token  # the step's token mean, once divided by completions
        if s.loss_type == "dapo":
            loss = per_token.sum() * per_completion_token
        elif s.loss_type == "grpo":
            tokens = torch.zeros(rows, device=logp.device, dtype=logp.dtype).index_add(0, row, torch.ones_like(logp))
            loss = (torch.zeros(rows, device=logp.device, dtype=logp.dtype).index_add(0, row, per_token)
                    / tokens.clamp(min=1)).sum()
        else:  # dr_grpo
            loss = per_token.sum() / s.max_completion_length
        skipped = batch.get("skipped", torch.zeros((), device=logp.device)).to(logp.dtype).reshape(1)
        stats = torch.cat([kl_sum.reshape(1), batch["row_stats"].to(logp.dtype).sum(0), skipped])
        return loss, stats
