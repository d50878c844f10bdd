"""`tunebench train --objective grpo`: GRPO on a file of prompts with reward functions (training/grpo.py), as one
recipe over training.recipe: inputs checked, the run opened, the model and prompts, the sampler, the held-out
reward before training, training (each step samples its groups first), the held-out reward after."""

from __future__ import annotations

from typing import Any

import numpy as np

from tunebench.data import batching, prompts
from tunebench.jobs import run_report
from tunebench.machine import distributed
from tunebench.machine.hardware import Decision
from tunebench.model import models
from tunebench.settings.finetune import RunConfig, dump_yaml
from tunebench.training import adapted, checkpoint, grpo, preference, recipe, rewards, runner, runplan
from tunebench.training.tune import compiler


def run(cfg: RunConfig) -> dict[str, Any]:
    a, d, s = cfg.adapter, cfg.data, cfg.schedule
    settings = grpo.Settings(a.num_generations, a.max_completion_length, a.temperature, a.top_p, a.beta, a.epsilon,
                             a.epsilon_high, a.loss_type, a.scale_rewards)
    rows, code, scoring = check_inputs(cfg)  # every input checked before anything expensive
    identity = {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "seed": s.seed, "data": d.path,
                **({"reward_files": code} if code else {})}
    opened = runner.open_run(cfg, identity)
    adapted.check_memory(cfg, opened)  # before a weight loads
    with distributed.local_rank0_first(opened.world):
        loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download,
                                adapted.load_dtype(cfg, opened))
        tok = loaded.tokenizer
        data = prompts.tokenize(rows, tok, d, a.max_completion_length)
    train_idx, _, eval_parts = adapted.split_rows(cfg, data, [np.arange(len(data))], [], True)
    held_out = np.concatenate(eval_parts).tolist()
    model, _, method_rows, (trainable, total) = adapted.trainable_model(cfg, loaded, opened, False)
    dropped = preference.disable_dropout(model)  # before the reference is copied, as for DPO
    reference, words = adapted.reference_for(model, a.method == "full") if a.beta else (None, "none (beta 0: no KL term)")
    method_rows.append(objective_row(cfg, words, dropped))
    compiled = []  # the plan's compile decision, once made: sampling runs without the compiled blocks
    sampler = grpo.Sampler(model, tok, data, rows, scoring, settings, opened.device, opened.autocast, s.seed,
                           eagerly=lambda: compiler.eagerly(compiled[0]))
    before: dict[str, float] = {}

    def start(plan):  # the held-out reward before training (greedy completions)
        compiled.append(plan.compile)
        before.update(sampler.held_out_reward(held_out) if held_out else {})
        if before:
            print(f"held-out reward before training: {describe(before)} on {len(held_out)} prompts")

    def finish(done: recipe.Finished):
        saved = adapted.save_final(model, tok, opened.out, cfg, loaded, done.weights)
        summary = adapted.summarize(cfg, opened, done.plan, model, done.outcome, trainable, done.measure_s)
        summary.update(generation(sampler, done.outcome, settings), prompts_dropped=data.dropped)
        if held_out:
            after = sampler.held_out_reward(held_out)
            print(f"held-out reward after training: {describe(after)} (before: {before['eval_reward']:.4f})")
            summary.update({"eval_reward_before": before["eval_reward"], **after})
        return summary, saved

    longest = sorted(train_idx.tolist(), key=lambda i: -data.lengths()[i])
    epoch_steps = sampler.record_steps(lambda epoch: batching.epoch_steps(train_idx, opened.effective, s.seed, epoch))
    return recipe.train(cfg, opened, recipe.Recipe(
        model=model, loss=grpo.GRPOLoss(model, settings, scoring, opened.autocast, reference),
        rows=runner.host_rows(cfg, opened.hw_plan), method_rows=method_rows,
        header=f"model: {loaded.source}\ndata: {d.path}, {len(train_idx)} train / {len(held_out)} held-out prompts"
               + (f"; {data.dropped} dropped: the prompt and --max-completion-length pass --max-length" if data.dropped
                  else "") + f"\ntrainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)",
        parallel=adapted.pick_parallel(cfg, opened, trainable), n_train=len(train_idx), unit="prompts",
        tokens_per_unit=float(a.num_generations * (data.lengths()[train_idx].mean() + a.max_completion_length)),
        # a probe step is a micro batch of groups at the longest completions, never sampled
        what=(cfg.model.name, f"{a.method}+grpo{a.num_generations}x{a.max_completion_length}", a.quantization, a.r,
              a.target_modules), probe_rows=lambda size: sampler.probe_rows(longest[:size]),
        widest=int(data.lengths()[train_idx].max()) + a.max_completion_length, max_length=d.max_length,
        attention_rows=min(opened.ask.micro or runplan.ATTENTION_ROWS, len(train_idx)),
        batches=lambda micro: (epoch_steps, sampler.collate, []), eval_sets=lambda micro: [], identity=identity,
        dump=dump_yaml, finish=finish, publish=run_report.send, quantized=a.method == "qlora",
        records={"trainable_parameters": trainable, "total_parameters": total, "model_source": loaded.source},
        before_training=start, prefetch=False,  # sampling needs the live weights
        watch_speed=False))  # the probe timed updates alone, and a step's time includes its sampling


def check_inputs(cfg: RunConfig):
    """(the prompts, the reward files' hashes, the rewards) read and checked: the columns the rewards read, a
    resume's reward files unchanged, enough prompts for a step, a model that can be found."""
    rows = prompts.load(cfg.data)
    code = rewards.files(cfg.adapter.reward)  # a resume runs the user's reward file again: the same file, or refused
    if code and cfg.output.resume:
        checkpoint.check_before_resume(cfg.output.output_dir, cfg.output.resume, {"reward_files": code})
    scoring = rewards.parse(cfg.adapter.reward, cfg.adapter.reward_weights)
    rewards.check_columns(scoring, rows.column_names(), cfg.data.path)
    print(f"data: {len(rows)} prompt(s) from {cfg.data.path}; rewards: "
          + ", ".join(f"{r.name} x {r.weight:g}" for r in scoring))
    adapted.check_rows(len(rows), cfg, 0, "")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    return rows, code, scoring


def objective_row(cfg: RunConfig, reference: str, dropped: int) -> Decision:
    a = cfg.adapter
    return Decision("objective", "grpo", f"{a.num_generations} completions a prompt of up to {a.max_completion_length} "
                    f"tokens at temperature {a.temperature:g} (top_p {a.top_p:g}); loss {a.loss_type}, advantages "
                    f"scaled by {a.scale_rewards}, epsilon {a.epsilon:g}/{a.epsilon_high:g}, beta {a.beta:g}; reference: "
                    f"{reference}" + (f"; base dropout off in {dropped} module(s)" if dropped else ""))


def generation(sampler: grpo.Sampler, outcome, s: grpo.Settings) -> dict[str, Any]:
    """Sampling measured apart from the update: generated tokens a second, and the update's tokens a second
    over the training time less the sampling (the loop's step times include a step's sampling)."""
    state = outcome.state
    update_s = max(state.train_time_s - sampler.generation_s, 1e-9)
    return {"objective": "grpo", "num_generations": s.num_generations, "generated_tokens": sampler.generated_tokens,
            "generation_s": round(sampler.generation_s, 3),
            "generation_tokens_per_s": sampler.generated_tokens / sampler.generation_s if sampler.generation_s else None,
            "update_s": round(update_s, 3), "update_tokens_per_s": state.tokens / update_s}


def describe(rewards_: dict[str, float]) -> str:
    return f"{rewards_['eval_reward']:.4f}" + "".join(
        f", {k[len('eval_rewards/'):-len('/mean')]} {v:.4f}" for k, v in rewards_.items() if k.startswith("eval_rewards/"))

