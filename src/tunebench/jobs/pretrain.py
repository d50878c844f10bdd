"""`tunebench pretrain`: train a causal LM from scratch, as one recipe over jobs/parts/recipe.py: the inputs checked,
the run opened, the tokenizer and token blocks, the model built, then the run the runner measures, plans,
trains and finishes, with a sampled continuation at each evaluation (jobs/parts/pretraining.py holds the parts)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tunebench.data import batching, blocks
from tunebench.jobs import run_report
from tunebench.jobs.parts import pretraining, recipe, runner
from tunebench.machine import distributed
from tunebench.model import arch
from tunebench.settings.pretrain import PretrainConfig, PretrainRun, validate
from tunebench.training import feed, runplan, stopping
from tunebench.training.autotune import Trained, compiler


@stopping.job
def run(cfg: PretrainRun | PretrainConfig) -> dict[str, Any]:
    cfg = validate(cfg)  # the CPU guide's trio becomes the run it describes
    m, d, s = cfg.model, cfg.data, cfg.schedule
    pretraining.check_inputs(cfg)
    identity = {"model": cfg.to_dict()["model"], "data": cfg.data_files, "seed": s.seed}
    opened = runner.open_run(cfg, identity)
    world, device = opened.world, opened.device
    with distributed.local_rank0_first(world):  # tokenized once, cached, memory-mapped by each machine's first rank
        tok, tok_source = pretraining.load_or_train_tokenizer(cfg)
        arch.check_vocab(m, tok)
        train, val, n_tokens = pretraining.token_blocks(cfg, tok, opened.hw_plan.threads)
    model = arch.build(m, tok, s.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    prompt = pretraining.sample_prompt(cfg.evaluation.sample_prompt, tok, val if len(val) else train)

    def sample(plan, step: int) -> dict[str, str]:
        # Rank 0 alone, on its whole replica; a sharded model's blocks are not whole on any rank.
        if not world.main or plan.parallel == "fsdp":
            return {}
        with compiler.eagerly(plan.compile):
            generated = pretraining.generate_sample(model, tok, prompt, cfg.evaluation.sample_tokens, s.seed, device,
                                                    opened.autocast)
        print(f"\nsample at step {step}: {generated!r}")
        return {"sample": generated}

    def finish(done: recipe.Finished):
        saved = pretraining.save(model, tok, opened.out, done.weights)
        return pretraining.summarize(cfg, opened, done.plan, model, done.outcome, n_params, done.measure_s), saved

    def batches(micro: int):
        return feed.Batches(lambda epoch: batching.epoch_steps(np.arange(len(train)), opened.effective, s.seed, epoch),
                              train.collate)

    return recipe.run(cfg, opened, recipe.Recipe(
        model=model,
        loss=None,
        rows=pretraining.model_rows(cfg, model, opened),
        method_rows=[],
        header=pretraining.header(tok_source, tok, cfg, n_tokens, train, val, model, n_params),
        parallel=pretraining.pick_parallel(cfg, opened, n_params),
        units=runplan.Units(
            n=len(train),
            name=f"blocks of {d.max_length}",
            tokens_each=d.max_length,
            what=Trained(f"pretrain:{arch.fingerprint(m)}", "pretrain", "none", None, None),
            probe_rows=lambda size: train.collate(range(min(size, len(train)))),
            widest=d.max_length,
            max_length=d.max_length,
            asked_reason="training.batch_size",
            batch_unit=f" blocks of {d.max_length}"),
        batches=batches,
        eval_sets=lambda micro: [("validation", val.batches(2 * micro))],
        identity=identity | {"tokenizer": blocks.tokenizer_hash(tok), "max_length": d.max_length,
                             "split": [d.split, d.validation_split, d.validation_file]},
        finish=finish,
        publish=run_report.send,
        records={"parameters": n_params},
        after_eval=sample))
