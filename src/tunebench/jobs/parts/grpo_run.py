"""What the GRPO recipe (jobs/grpo.py) needs around the algorithm in training/grpo/__init__.py, as finetune_data and
finetune_report are for SFT: its inputs checked (prompts, rewards, lengths), its rows in the settings table and
its measurement key, and its figures (sampling against updating, the held-out reward before and after)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tunebench.core.decision import Decision
from tunebench.core.userfile import UserFile
from tunebench.data import batching, prompts
from tunebench.data.prompts import PromptData, PromptRows
from tunebench.data.tokenize import render_prompt
from tunebench.jobs.parts import finetune_data
from tunebench.jobs.parts.runner import Opened
from tunebench.machine import distributed
from tunebench.machine.distributed import World
from tunebench.model import models
from tunebench.settings.finetune import RunConfig
from tunebench.settings.objectives import GRPO, NEGATIVE_WEIGHT_EPISODES, RFT
from tunebench.training import checkpoint, objective, preference
from tunebench.training.autotune import Trained
from tunebench.training.grpo import (
    Advantages,
    Completions,
    Credit,
    Draws,
    GRPOLoss,
    Sampling,
    environment,
    episodes,
    rft,
)
from tunebench.training.grpo import rewards as rewards_
from tunebench.training.grpo.environment import Environment
from tunebench.training.grpo.watch import Kinds
from tunebench.training.objective import Batch


def check_inputs(cfg: RunConfig) -> tuple[PromptRows, dict, list[rewards_.Reward], Environment | None, Kinds | None]:
    """(the prompts, the reward and environment files' hashes, the rewards, the environment, the prompts' kinds)
    read and checked: the environment's names, the columns the rewards read, the kind column, a resume's files
    unchanged, enough prompts for a step, a model that can be found. With an environment, each row's prompt is
    reset(row)'s opening messages."""
    o = cfg.objective
    # the user's files read and hashed before any of them runs: a resume runs them again, the same bytes or refused
    read = rewards_.files(o.reward)
    env_file = UserFile.read(environment.resolve(o.environment)) if o.environment else None
    code = {p: f.sha256 for p, f in read.items()} | ({str(env_file.path): env_file.sha256} if env_file else {})
    if code and cfg.output.resume:
        checkpoint.check_user_code(cfg.output.output_dir, cfg.output.resume, code)  # even with no checkpoint yet
        checkpoint.check_before_resume(cfg.output.output_dir, cfg.output.resume, {"reward_files": code})
    env = environment.load(o.environment, o.tool_timeout, env_file) if o.environment else None
    rows = prompts_of(cfg.data, env)
    scoring = rewards_.parse(cfg.objective.reward, cfg.objective.reward_weights, read)
    rewards_.check_columns(scoring, rows.column_names(), cfg.data.path)
    kinds = Kinds.of(o.kind_column, rows.columns)
    print(f"data: {len(rows)} prompt(s) from {cfg.data.path}; rewards: "
          + ", ".join([*(["environment x 1"] if env else []), *(f"{r.name} x {r.weight:g}" for r in scoring)])
          + (f"; environment {o.environment}: tools {', '.join(env.tools)}" if env else ""))
    finetune_data.check_rows(len(rows), cfg, 0, "")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    return rows, code, scoring, env, kinds


def prompts_of(data, env: Environment | None) -> PromptRows:
    """The data's rows as prompts: read as prompt rows, or, with an environment, each row's opening from reset(row)."""
    return prompts.load(data) if env is None else environment.rows(env, data)


def tokenized(rows: PromptRows, tok, env: Environment | None, cfg: RunConfig) -> tuple[PromptData, Decision | None]:
    """The prompts tokenized as the run renders them (an episode's opening with its tools), and the settings row of
    the chat template episodes take, set before a prompt renders (None without an environment)."""
    o = cfg.objective
    if env is None:
        return prompts.tokenize(rows, tok, cfg.data, o.max_completion_length), None
    template_row = episodes.template_for(tok, env.schemas, rows.prompts[0])
    return episodes.tokenize(rows, tok, env, cfg.data.max_length, o.max_completion_length), template_row


def draws_of(on: Sampling, env: Environment | None, rows: PromptRows, cfg: RunConfig) -> Draws:
    """Where a step's completions come from: episodes in the environment, or single replies."""
    return episodes.Episodes(on, env, rows.prompts, cfg.objective.max_turns, cfg.data.max_length) if env else \
        Completions(on)


def prompt_lengths(rows: PromptRows, cfg: RunConfig, env: Environment | None):
    """`finetune_data.settle_length`'s measure for GRPO: each prompt's tokens as generation renders it, plus a full
    completion (max_completion_length); an episode's opening (its tools rendered), plus max_turns of them."""
    o = cfg.objective

    def lengths(tok, sample) -> list[int]:
        if env is not None:
            episodes.template_for(tok, env.schemas, rows.prompts[0])
            return [len(episodes.opening_ids(tok, env, rows.prompts[i])) + o.max_turns * o.max_completion_length
                    for i in sample(len(rows.prompts))]
        return [len(tok(render_prompt(rows.prompts[i], tok, cfg.data.template), add_special_tokens=False)["input_ids"])
                + o.max_completion_length for i in sample(len(rows.prompts))]

    return lengths


def epoch_steps(o: GRPO | RFT, train_idx, effective: int, seed: int, kinds, data: PromptData
                ) -> Callable[[int], list[list[int]]]:
    """epoch -> its optimizer steps' prompts: shuffled (batching.epoch_steps), or with --balance-kinds each kind in
    turn (batching.balanced_steps; `kinds` the watch.Kinds of --kind-column, which --balance-kinds needs)."""
    if not o.balance_kinds:
        steps = lambda epoch: batching.epoch_steps(train_idx, effective, seed, epoch)  # noqa: E731
    else:
        kind_of = {int(k): kinds.of_row[data.source(int(k))] for k in train_idx}
        steps = lambda epoch: batching.balanced_steps(train_idx, kind_of, effective, seed, epoch)  # noqa: E731
    repeat = getattr(o, "num_iterations", 1)  # each draw trained on that many steps in a row (training/grpo/steps.py)
    return steps if repeat == 1 else lambda epoch: [step for step in steps(epoch) for _ in range(repeat)]


def logps_now(model, batch: Batch, opened: Opened, temperature: float) -> torch.Tensor:
    """A micro batch's log-probabilities at its loss positions under the policy as it is, without gradients: what
    --num-iterations' later updates take their ratio against (kept on the CPU with the batch)."""
    on = objective.prepare(batch, opened.device)[0]
    with torch.no_grad():
        return preference.token_logps(model, on, on["loss_index"], opened.autocast, temperature).cpu()


def slice_of(o: GRPO | RFT) -> tuple[type, Credit]:
    """A sampling objective's loss class and the step's credit, by its settings' type: GRPO's (advantages within
    each group) or RFT's (the kept completions' weights)."""
    if isinstance(o, RFT):
        return rft.RFTLoss, rft.Kept(o)
    return GRPOLoss, Advantages(o)


def objective_row(cfg: RunConfig, reference: str, dropped: int) -> Decision:
    o = cfg.objective
    if isinstance(o, RFT):
        where = (f"{o.num_generations} episodes a prompt in {o.environment}, up to {o.max_turns} turns of up to "
                 f"{o.max_completion_length} tokens, tool calls limited to {o.tool_timeout:g} s" if o.environment
                 else f"{o.num_generations} completions a prompt of up to {o.max_completion_length} tokens")
        keep = "above 0" if o.min_reward is None else f"at least {o.min_reward:g}"
        return Decision("objective", o.name, f"{where} sampled each step at temperature {o.temperature:g} (top_p "
                        f"{o.top_p:g}); those whose reward is {keep} kept (one of identical ones in a prompt's), "
                        "trained on with the next-token loss over the step's kept tokens"
                        + (f", each kind of {o.kind_column} an equal share" if o.kind_column else "") + _extras(o)
                        + (f"; base dropout off in {dropped} module(s)" if dropped else ""))
    if o.environment:
        return Decision("objective", o.name, f"{o.num_generations} episodes a prompt in {o.environment}, up to "
                        f"{o.max_turns} turns of up to {o.max_completion_length} tokens (the loss on the model's own "
                        f"tokens; tool turns are context), tool calls limited to {o.tool_timeout:g} s; temperature "
                        f"{o.temperature:g} (top_p {o.top_p:g}); loss {o.loss_type}, advantages scaled by "
                        f"{o.scale_rewards}, each turn's "
                        + ("against the turns that reached the same context (GiGPO)" if o.turn_credit == "state"
                           else "against its group's turns pooled") + f", beta {o.beta:g}; reference: {reference}"
                        + _extras(o)
                        + (f"; base dropout off in {dropped} module(s)" if dropped else ""))
    return Decision("objective", o.name, f"{o.num_generations} completions a prompt of up to {o.max_completion_length} "
                    f"tokens at temperature {o.temperature:g} (top_p {o.top_p:g}); loss {o.loss_type}, advantages "
                    f"scaled by {o.scale_rewards}, epsilon {o.epsilon:g}/{o.epsilon_high:g}, beta {o.beta:g}; reference: "
                    f"{reference}" + _extras(o) + (f"; base dropout off in {dropped} module(s)" if dropped else ""))


def _extras(o: GRPO | RFT) -> str:
    """What the objective's row adds for the settings that change which completions a step learns from."""
    return ((f"; a group that scored alike drawn again up to {o.resample_alike} time(s) (dynamic sampling)"
             if getattr(o, "resample_alike", 0) else "")
            + (f"; each step's prompts one of each kind of {o.kind_column} in turn" if o.balance_kinds else "")
            + (f"; each kind of {o.kind_column} that teaches an equal share of a step's update"
               if getattr(o, "weigh_kinds", False) else "")
            + (f"; each credit below 0 x {o.negative_weight:g} (--negative-weight"
               + (f"; {NEGATIVE_WEIGHT_EPISODES:g} unless given with --environment, chosen on the towns benchmark's "
                  "validation set)" if o.environment else ")")
               if getattr(o, "negative_weight", 1.0) != 1.0 else "")
            + (f"; each draw trained on for {o.num_iterations} steps, their ratios against its log-probabilities "
               f"when drawn (clipped at 1 -/+ {o.epsilon:g}/{o.epsilon_high:g})"
               if getattr(o, "num_iterations", 1) > 1 else ""))


def header(source: str, cfg: RunConfig, data: PromptData, n_train: int, n_held_out: int, trainable: int,
           total: int) -> str:
    """The lines above the settings table: the model, the prompts and their split, what trains."""
    dropped = (f"; {data.dropped} dropped: the prompt and --max-completion-length pass --max-length" if data.dropped
               else "")
    return (f"model: {source}\ndata: {cfg.data.path}, {n_train} train / {n_held_out} held-out prompts{dropped}\n"
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")


def measured_as(cfg: RunConfig) -> Trained:
    """What is trained, as the measurement cache keys it: a probe step is a micro batch of groups at the longest
    completions, never sampled."""
    a, o = cfg.adapter, cfg.objective
    episodes = f"+episodes{o.max_turns}" if o.environment else ""  # whole contexts: not a single turn's probe
    iterations = getattr(o, "num_iterations", 1)  # a draw's later steps sample nothing: another step time
    episodes += f"+iterations{iterations}" if iterations > 1 else ""
    return Trained(cfg.model.name, f"{a.method}+{o.name}{o.num_generations}x{o.max_completion_length}{episodes}",
                   a.quantization, a.r, a.target_modules)


def generation(ranks: list[dict[str, Any]], outcome, s: GRPO) -> dict[str, Any]:
    """Sampling measured apart from the update, from each rank's figures (its "generated_tokens", the context
    tokens it fed the model, "prefilled_tokens", and "generation_s"): generated tokens a second (all ranks' tokens over the slowest rank's sampling time, the ranks
    sampling side by side), and the update's tokens a second over the training time less that sampling (rank 0's
    step times include its own sampling and the wait for the slowest rank's)."""
    state = outcome.state
    tokens, seconds = sum(r["generated_tokens"] for r in ranks), max(r["generation_s"] for r in ranks)
    update_s = max(state.train_time_s - seconds, 1e-9)
    return {"objective": s.name, "num_generations": s.num_generations, "generated_tokens": tokens,
            "prefilled_tokens": sum(r["prefilled_tokens"] for r in ranks),
            # --resample-alike: groups drawn again for scoring alike, and those the fresh draw made informative
            "groups_redrawn": sum(r["refills"][0] for r in ranks), "groups_refilled": sum(r["refills"][1] for r in ranks),
            # the slowest rank's seconds in each part of its sampling (grpo.SPLIT)
            "sampling_split_s": {k: round(max(r["times"][k] for r in ranks), 3) for k in ranks[0]["times"]},
            "generation_s": round(seconds, 3), "generation_tokens_per_s": tokens / seconds if seconds else None,
            "update_s": round(update_s, 3), "update_tokens_per_s": state.tokens / update_s}


def rank_figures(on: Sampling, held_out: HeldOutReward) -> dict[str, Any]:
    """What each rank counted itself, read on every rank once training has ended (recipe.Recipe.rank_figures) and
    gathered for rank 0: its sampling's tokens and seconds (for `generation`), its held-out rows (for
    HeldOutReward.after)."""
    return {"generated_tokens": on.generated_tokens, "generation_s": on.generation_s,
            "prefilled_tokens": on.prefilled, "times": on.times, "refills": on.refills, "held_out": held_out.mine()}


class HeldOutReward:
    """The held-out prompts' reward (greedy completions) before training and after, printed by rank 0 as each is
    taken; nothing where no prompt is held out. The prompts are decoded in batches of `batch_size`, as one process
    makes them, each rank every world-size-th batch (as objective.evaluate shares held-out batches), and rank 0 reads
    every rank's rows: the figures are one process's, in a share of its time."""

    def __init__(self, draws: Draws, keys: list[int], world: World, batch_size: int = 8):
        self.draws, self.keys, self.world, self.start = draws, keys, world, {}
        self.chunks = [keys[i:i + batch_size] for i in range(0, len(keys), batch_size)]

    def mine(self) -> list[list[float]]:
        """This rank's rows (Draws.held_out_scores) of the held-out prompts, at the model's weights now; on every
        rank, before training (`before`) and after it (gathered for `after`)."""
        return self.draws.held_out_scores(self.chunks[self.world.rank::self.world.size]) if self.keys else []

    def before(self) -> None:
        """On every rank, before the first step."""
        if not self.keys:
            return
        rows = distributed.gather(self.world, self.mine())
        if rows is not None:
            self.start = self.draws.held_out_figures([row for part in rows for row in part])
            print(f"held-out reward before training: {describe(self.start)} on {len(self.keys)} prompts")

    def after(self, ranks: list[dict[str, Any]]) -> dict[str, float]:
        """Rank 0: the figures after training from every rank's rows (each rank's figures' "held_out": its `mine`
        once training has ended), beside those before."""
        if not self.keys:
            return {}
        after = self.draws.held_out_figures([row for r in ranks for row in r["held_out"]])
        print(f"held-out reward after training: {describe(after)} (before: {self.start['eval_reward']:.4f})")
        return {"eval_reward_before": self.start["eval_reward"], **after,
                **{f"{k}_before": v for k, v in self.start.items() if k.startswith("eval_episodes/")}}


def describe(reward: dict[str, float]) -> str:
    """The held-out figures in a line: the reward and each reward's; for episodes, their success, turns and calls."""
    text = f"{reward['eval_reward']:.4f}" + "".join(
        f", {k[len('eval_rewards/'):-len('/mean')]} {v:.4f}" for k, v in reward.items() if k.startswith("eval_rewards/"))
    if "eval_episodes/success" in reward:
        ran = reward["eval_episodes/calls_ok"]
        text += (f"; episodes: {reward['eval_episodes/success']:.0%} succeeded, {reward['eval_episodes/turns']:.2f} "
                 f"turns and {reward['eval_episodes/calls']:.2f} calls each"
                 + (f", {ran:.0%} of the calls ran" if ran is not None else ""))
    return text
