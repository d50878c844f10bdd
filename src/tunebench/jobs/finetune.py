"""`tunebench train`: SFT (LoRA, QLoRA, full, PEFT methods) and DPO, ORPO, KTO, as one recipe over jobs/parts/recipe.py:
inputs checked, the run opened, model and data, then what the runner measures, batches, trains and finishes."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tunebench.data import batching, mixture
from tunebench.jobs import run_report
from tunebench.jobs.parts import finetune_data, finetune_model, finetune_report, recipe, runner
from tunebench.machine import distributed
from tunebench.model import models
from tunebench.settings.finetune import RunConfig
from tunebench.training import runplan, stopping


@stopping.job
def run(cfg: RunConfig) -> dict[str, Any]:
    a, d, o = cfg.adapter, cfg.data, cfg.objective
    prefer, unit = o.preference, o.unit  # DPO/ORPO: a pair; KTO: a judged completion; SFT: a row
    examples, parts = finetune_data.check_inputs(cfg)  # every input checked before anything expensive
    cfg, length_row = finetune_data.settle_length(cfg, finetune_data.row_lengths(cfg, examples, parts))
    d = cfg.data
    identity = finetune_model.identity(cfg)
    opened = runner.open_run(cfg, identity)
    finetune_model.check_memory(cfg, opened)  # before a weight loads
    with distributed.local_rank0_first(opened.world):  # each machine's first rank fills the caches
        loaded = finetune_model.load(cfg, opened)
        tok = loaded.tokenizer
        if prefer:  # the pairs or judgements that fit max_length, one span
            data, messages = finetune_data.JUDGEMENTS[o.data].tokenize(examples, tok, d), []
            spans = [np.arange(len(data))]
        else:
            data, spans, messages = mixture.tokenize(parts, tok, models.cache_dir())
    train_idx, _, eval_parts = finetune_data.split_rows(cfg, data, spans, parts)
    model, loss, method_rows, (trainable, total) = finetune_model.trainable_model(cfg, loaded, opened)
    lengths = data.lengths()  # of each unit: an example, or a pair's longer row
    # rows rounded where a CPU's bf16 builds kernels per length (rows, pairs, judgements and their KL rows)
    unit_collate = finetune_data.JUDGEMENTS[o.data].collate if prefer else batching.collate
    padding = batching.pad_multiple(opened.device.type, opened.hw_plan.precision)
    collate_unit = functools.partial(unit_collate, multiple=padding.value, cap=d.max_length)
    longest = sorted(train_idx.tolist(), key=lambda i: -lengths[i])

    def finish(done: recipe.Finished):
        saved = finetune_model.save_final(model, tok, opened.out, cfg, loaded, done.weights)
        summary = finetune_report.summarize(cfg, opened, done.plan, model, done.outcome, trainable, done.measure_s)
        if prefer:
            summary.update({f"{unit}_skipped": examples.skipped, f"{unit}_dropped": data.dropped})
        summary.update(finetune_report.held_out_answers(cfg, opened, model, tok, data, examples, messages, parts,
                                                        eval_parts))
        return summary, saved

    def eval_sets(micro: int) -> list:
        names = [p.name for p in parts] or ["pairs"]
        return [(name, batching.eval_batches(data, e, micro * 2, tok.pad_token_id, collate_unit))
                for name, e in zip(names, eval_parts) if len(e)]

    return recipe.run(cfg, opened, recipe.Recipe(
        model=model,
        objective=cfg.objective,
        loss=loss,
        method_rows=[length_row, padding, *method_rows, *finetune_data.template_rows(tok)],
        header=finetune_report.header(cfg, loaded, parts, data, len(train_idx), eval_parts, unit, trainable, total),
        parallel=finetune_model.pick_parallel(cfg, opened, trainable),
        units=runplan.Units(
            n=len(train_idx),
            name=unit,
            tokens_each=float(np.mean((data.tokens() if prefer else lengths)[train_idx])),
            what=finetune_model.measured_as(cfg),
            probe_rows=lambda size: collate_unit(data, longest[:size], tok.pad_token_id),
            rows_near=lambda size, width: collate_unit(
                data, train_idx[np.argsort(np.abs(lengths[train_idx] - width), kind="stable")[:size]].tolist(),
                tok.pad_token_id),
            # packed rows fill max_length, so a kernel must fit that, not just the longest example
            widest=d.max_length if d.packing != "off" else batching.padded_width(
                int(lengths[train_idx].max()), padding.value, d.max_length),
            max_length=d.max_length,
            quantized=a.method == "qlora",
            longest=int(lengths[train_idx].max()),
            **finetune_model.fixed_micro_batch(opened, o)),
        batches=finetune_data.batcher(cfg, opened, data, train_idx, collate_unit, tok.pad_token_id),
        eval_sets=eval_sets,
        identity=identity,
        finish=finish,
        publish=run_report.send,
        records=finetune_model.records(loaded, trainable, total)))
