"""`tunebench train --objective grpo` (or rft): GRPO (or rejection-sampling fine-tuning) on prompts with rewards or
on episodes in an environment, its slice in training/grpo/, one recipe over jobs/parts/recipe.py; a step's data is
training/grpo/steps.py's DrawnSteps."""

from typing import Any

import numpy as np

from tunebench.data import batching
from tunebench.jobs import run_report
from tunebench.jobs.parts import finetune_data, finetune_model, finetune_report, grpo_run, recipe, runner
from tunebench.machine import distributed
from tunebench.settings.finetune import RunConfig
from tunebench.training import feed, grpo, preference, runplan, stopping
from tunebench.training.autotune import compiler
from tunebench.training.grpo import steps, watch


@stopping.job
def run(cfg: RunConfig) -> dict[str, Any]:
    a, o, s = cfg.adapter, cfg.objective, cfg.schedule
    rows, code, scoring, env, kinds = grpo_run.check_inputs(cfg)  # every input checked before anything expensive
    cfg, length_row = finetune_data.settle_length(cfg, grpo_run.prompt_lengths(rows, cfg, env))  # max_length a number
    identity = finetune_model.identity(cfg, **({"reward_files": code} if code else {}))
    opened = runner.open_run(cfg, identity)
    finetune_model.check_memory(cfg, opened)  # before a weight loads
    with distributed.local_rank0_first(opened.world):
        tok = (loaded := finetune_model.load(cfg, opened)).tokenizer
        data, template_row = grpo_run.tokenized(rows, tok, env, cfg)
    train_idx, _, eval_parts = finetune_data.split_rows(cfg, data, [np.arange(len(data))], [])
    model, _, method_rows, (trainable, total) = finetune_model.trainable_model(cfg, loaded, opened)
    dropped = preference.disable_dropout(model)  # before the reference is copied, as for DPO
    reference, words = preference.reference_for(model, a.method == "full") if o.reference_forwards else \
        (None, "none (beta 0: no KL term)")
    loss_class, credit = grpo_run.slice_of(o)  # GRPO's loss and advantages, or RFT's and its kept ones
    compiled = []  # the plan's compile decision, once made: sampling runs without the compiled blocks
    on = grpo.Sampling(model, tok, data, rows, scoring, o, opened.device, opened.autocast,
                       eagerly=lambda: compiler.eagerly(compiled[0]))
    draws = grpo_run.draws_of(on, env, rows, cfg)
    held_out = grpo_run.HeldOutReward(draws, np.concatenate(eval_parts).tolist(), opened.world)

    lengths = data.lengths()
    widest = cfg.data.max_length if env else int(lengths[train_idx].max()) + o.max_completion_length
    padding = batching.pad_multiple(opened.device.type, opened.hw_plan.precision)  # as finetune's rows
    iterations = getattr(o, "num_iterations", 1)
    step_rows = steps.StepRows(
        draws, kinds, watch.Watch(kinds, print if opened.world.main else lambda _: None, o.alike_fix()), credit,
        (padding.value, widest),
        (lambda batch: grpo_run.logps_now(model, batch, opened, o.temperature)) if iterations > 1 else None)

    def start(plan):
        compiled.append(plan.compile)
        held_out.before()

    def finish(done: recipe.Finished):
        saved = finetune_model.save_final(model, tok, opened.out, cfg, loaded, done.weights)
        summary = finetune_report.summarize(cfg, opened, done.plan, model, done.outcome, trainable, done.measure_s)
        summary.update(grpo_run.generation(done.ranks, done.outcome, o), prompts_dropped=data.dropped,
                       **({"environment": o.environment} if env else {}), **held_out.after(done.ranks))
        return summary, saved

    longest = sorted(train_idx.tolist(), key=lambda i: -lengths[i])
    epoch_steps = grpo_run.epoch_steps(o, train_idx, opened.effective, s.seed, kinds, data)
    return recipe.run(cfg, opened, recipe.Recipe(
        model=model,
        objective=cfg.objective,
        loss=loss_class(model, o, draws.reward_names(), opened.autocast, reference, draws.episode_stats, kinds),
        method_rows=[length_row, padding, *method_rows, grpo_run.objective_row(cfg, words, dropped),
                     *([template_row] if template_row else [])],
        header=grpo_run.header(loaded.source, cfg, data, len(train_idx), len(held_out.keys), trainable, total),
        parallel=finetune_model.pick_parallel(cfg, opened, trainable),
        units=runplan.Units(
            n=len(train_idx), name="prompts",
            tokens_each=float(o.num_generations * (lengths[train_idx].mean() + o.max_completion_length)),  # a turn
            what=grpo_run.measured_as(cfg),
            probe_rows=lambda size: step_rows.probe_rows(longest[:size]),
            widest=widest,
            max_length=cfg.data.max_length, quantized=a.method == "qlora",
            rows_each=o.num_generations),
        batches=lambda micro: feed.Batches(epoch_steps, step_rows.collate, sampler=lambda rows: steps.DrawnSteps(
            rows, step_rows, s.seed, iterations, opened.world.rank)),
        eval_sets=lambda micro: [],
        identity=identity,
        finish=finish,
        publish=run_report.send,
        records=finetune_model.records(loaded, trainable, total),
        before_training=start,
        rank_figures=lambda: grpo_run.rank_figures(on, held_out)))
