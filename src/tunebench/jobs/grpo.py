"""`tunebench train --method grpo`: GRPO on a file of prompts with reward functions (training/grpo.py). Reads
top to bottom like fine-tuning, whose steps it shares: plan the hardware, load the model and prompts, set up the
method, decide the measured settings, measure the held-out reward, train (each step sampling its groups first),
measure it again, save."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tunebench.core.jsonfile import write_json
from tunebench.data import batching, prompts
from tunebench.jobs import finetune, run_report
from tunebench.machine import distributed
from tunebench.machine.hardware import Decision
from tunebench.model import models
from tunebench.settings.finetune import RunConfig, dump_yaml
from tunebench.training import checkpoint, grpo, optim, preference, rewards, runner, runplan
from tunebench.training import summary as summary_
from tunebench.training.tune import compiler
from tunebench.training.tune.probe import probe_step


def run(cfg: RunConfig) -> dict[str, Any]:
    a, d, s = cfg.adapter, cfg.data, cfg.schedule
    settings = grpo.Settings(a.num_generations, a.max_completion_length, a.temperature, a.top_p, a.beta, a.epsilon,
                             a.epsilon_high, a.loss_type, a.scale_rewards)
    # -- every input checked before anything expensive: the prompts, the rewards and the columns they read
    rows = prompts.load(d)
    code = rewards.files(a.reward)  # a resume runs the user's reward file again: the same file, or refused
    if code and cfg.output.resume:
        checkpoint.check_before_resume(cfg.output.output_dir, cfg.output.resume, {"reward_files": code})
    scoring = rewards.parse(a.reward, a.reward_weights)
    rewards.check_columns(scoring, rows.column_names(), d.path)
    print(f"data: {len(rows)} prompt(s) from {d.path}; rewards: " + ", ".join(f"{r.name} x {r.weight:g}" for r in scoring))
    finetune.check_rows(len(rows), cfg, 0, "")
    models.check_spec(cfg.model.name, cfg.model.allow_download)

    # -- the run opened, the model and prompts
    identity = {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "seed": s.seed, "data": d.path,
                **({"reward_files": code} if code else {})}
    opened = runner.open_run(cfg, identity)
    world, device, effective = opened.world, opened.device, opened.effective
    with distributed.local_rank0_first(world):
        loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download)
        tok = loaded.tokenizer
        data = prompts.tokenize(rows, tok, d, a.max_completion_length)
    train_idx, _, eval_parts = finetune.split_rows(cfg, data, [np.arange(len(data))], [], True)
    held_out = np.concatenate(eval_parts).tolist()
    model, autocast, _, method_rows, (trainable, total) = finetune.trainable_model(cfg, loaded, opened, False)
    dropped = preference.disable_dropout(model)  # before the reference is copied, as for DPO
    reference, words = finetune.reference_for(model, a.method == "full") if a.beta else (None, "none (beta 0: no KL term)")
    method_rows.append(objective_row(cfg, words, dropped))
    loss_module = grpo.GRPOLoss(model, settings, scoring, autocast, reference)

    # -- measured decisions: a probe step is a micro batch of groups at the longest completions, never sampled
    sampler = grpo.Sampler(model, tok, data, rows, scoring, settings, device, autocast, s.seed,
                           eagerly=lambda: compiler.eagerly(plan.compile))  # generate without the compiled blocks
    unit_tokens = float(a.num_generations * (data.lengths()[train_idx].mean() + a.max_completion_length))
    steps = runplan.total_steps(len(train_idx), effective, s.epochs, s.max_steps, s.max_tokens, unit_tokens)
    parallel = finetune.pick_parallel(cfg, opened, trainable)
    longest = sorted(train_idx.tolist(), key=lambda i: -data.lengths()[i])
    measured, measure_s = runner.measure(
        opened, cfg, model, probe_step(model, lambda size: sampler.probe_rows(longest[:size]), device, autocast,
                                       loss_module),
        (cfg.model.name, f"{a.method}+grpo{a.num_generations}x{a.max_completion_length}", a.quantization, a.r,
         a.target_modules), max_length=d.max_length,
        attention_rows=min(opened.ask.micro or cfg.batch.micro_batch_size, len(train_idx)),
        widest=int(data.lengths()[train_idx].max()) + a.max_completion_length, n_train=len(train_idx),
        run_tokens=steps * effective * unit_tokens, parallel=parallel, quantized=a.method == "qlora")
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    optimization, lr_row = runner.learning_rate(cfg, effective, steps)
    plan = runplan.make(opened.hw_plan, world, parallel, measured, effective, accum, steps, [
        *runner.host_rows(cfg, opened.hw_plan), Decision("world", world.size, world.describe()), parallel,
        *method_rows, *measured.decisions, optim.optimizer_row(device, optimization.weight_decay),
        runplan.batch_row(effective, micro, accum, world.size), lr_row,
        runplan.logging_row(cfg.logging.logging_steps, device.type),
        runner.steps_row(cfg, steps, f"{len(train_idx)} prompts, {effective} a step")])
    # The probe timed updates alone, and a step's time includes its sampling: no slowdown watch against it
    plan = dataclasses.replace(plan, probed_tokens_per_s=None)
    if world.main:
        print(f"model: {loaded.source}\ndata: {d.path}, {len(train_idx)} train / {len(held_out)} held-out prompts"
              + (f"; {data.dropped} dropped: the prompt and --max-completion-length pass --max-length" if data.dropped
                 else "") + f"\ntrainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")
        summary_.print_plan(plan.decisions)

    # -- the held-out reward before training (greedy completions), then training: each step samples its groups
    before = sampler.held_out_reward(held_out) if held_out else {}
    if before:
        print(f"held-out reward before training: {describe(before)} on {len(held_out)} prompts")
    next_micro_batch = runner.micro_batches(sampler.record_steps(lambda epoch: batching.epoch_steps(
        train_idx, effective, s.seed, epoch)), sampler.collate, world, micro, accum)
    records = runner.records(opened, cfg, plan, dump_yaml, trainable_parameters=trainable,
                             total_parameters=total, model_source=loaded.source)
    with runner.tracking(opened, cfg.logging) as tracking:
        outcome, weights = runner.train_run(
            opened, plan, model, loss=loss_module, records=records, optimization=optimization,
            outputs=runner.Outputs.of(cfg, int(plan.value("logging_steps"))), next_micro_batch=next_micro_batch,
            eval_sets=[], identity=identity, tracking=tracking, prefetch=False)  # sampling needs the live weights
        if not world.main:
            return {}
        saved = finetune.save_final(model, tok, opened.out, cfg, loaded, weights)
        summary = finetune.summarize(cfg, opened, plan, model, outcome, trainable, measure_s)
        summary.update(generation(sampler, outcome, settings), prompts_dropped=data.dropped)
        if held_out:
            after = sampler.held_out_reward(held_out)
            print(f"held-out reward after training: {describe(after)} (before: {before['eval_reward']:.4f})")
            summary.update({"eval_reward_before": before["eval_reward"], **after})
        summary.update(tracking.costs())
        write_json(opened.out / "summary.json", summary)
        summary_.report(summary, opened.out)
        run_report.send(tracking, summary, opened.out, saved if cfg.logging.log_model else [])
    return summary


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

