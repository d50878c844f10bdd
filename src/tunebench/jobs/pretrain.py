"""`tunebench pretrain`: train a causal LM from scratch. Reads top to bottom: check the inputs, plan
the hardware, tokenizer and token blocks, build the model, decide the measured settings, train,
save. The loop, the measured decisions and the run plumbing are the ones `train` uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core.durable import atomic_files, landing
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.data import batching, blocks, text
from tunebench.jobs import run_report
from tunebench.jobs import tokenizer as tokenizer_job
from tunebench.machine import distributed, hardware, metrics
from tunebench.machine.hardware import Decision
from tunebench.machine.metrics import training_flops_per_token
from tunebench.model import arch, inference, kernels, models
from tunebench.settings.pretrain import PretrainConfig, PretrainRun, dump_yaml, validate
from tunebench.training import optim, runner, runplan
from tunebench.training import summary as summary_
from tunebench.training.tune import compiler
from tunebench.training.tune.probe import enable_checkpointing, memory_free_mb, probe_step


def run(cfg: PretrainRun | PretrainConfig) -> dict[str, Any]:
    cfg = validate(cfg)  # the CPU guide's trio becomes the run it describes
    m, d = cfg.model, cfg.data
    check_inputs(cfg)

    # -- the run opened: hardware plan, process group, output directory and resume point, batch, seed
    identity = {"model": cfg.to_dict()["model"], "data": cfg.data_files, "seed": cfg.schedule.seed}
    opened = runner.open_run(cfg, identity)
    world, device, effective = opened.world, opened.device, opened.effective

    # -- tokenizer and token blocks (tokenized once, cached, memory-mapped; each machine's first rank fills the caches)
    with distributed.local_rank0_first(world):
        tok, tok_source = load_or_train_tokenizer(cfg)
        arch.check_vocab(m, tok)
        train, val, n_tokens = token_blocks(cfg, tok, opened.hw_plan.threads)

    # -- model
    model = arch.build(m, tok, cfg.schedule.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    rows = model_rows(cfg, model, opened)

    # -- measured decisions: attention kernel, micro batch (the effective batch stays fixed), compile
    s = cfg.schedule
    steps = runplan.total_steps(len(train), effective, s.epochs, s.max_steps, s.max_tokens, d.max_length)
    parallel = hardware.pick_parallel(cfg.distributed.parallel, "pretrain", n_params, world.size,
                                      memory_free_mb(device, world.local_size))
    measured, measure_s = runner.measure(
        opened, cfg, model, probe_step(model, lambda size: train.collate(range(min(size, len(train)))), device,
                                       opened.autocast),
        (f"pretrain:{arch.fingerprint(m)}", "pretrain", "none", None, None), max_length=d.max_length,
        widest=d.max_length, attention_rows=cfg.batch.micro_batch_size, n_train=len(train),
        run_tokens=steps * effective * d.max_length, parallel=parallel, asked_reason="training.batch_size")
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    optimization, lr_row = runner.learning_rate(cfg, effective, steps)
    plan = runplan.make(opened.hw_plan, world, parallel, measured, effective, accum, steps, [
        *rows, Decision("world", world.size, world.describe()), parallel, *measured.decisions,
        optim.optimizer_row(device, optimization.weight_decay),
        runplan.batch_row(effective, micro, accum, world.size, f" blocks of {d.max_length}"), lr_row,
        runplan.logging_row(cfg.logging.logging_steps, device.type),
        runner.steps_row(cfg, steps, f"{len(train)} blocks of {d.max_length}")])
    if world.main:
        print(f"tokenizer: {tok_source} ({len(tok):,} tokens)\ndata: {', '.join(cfg.data_files)}: {n_tokens:,} "
              f"tokens, {len(train):,} train / {len(val):,} validation blocks of {d.max_length}\n"
              f"model: {type(model).__name__}, {n_params:,} parameters")
        summary_.print_plan(plan.decisions)

    # -- batches: each epoch's optimizer steps of blocks (seed, epoch, effective batch), this rank's share of each
    next_micro_batch = runner.micro_batches(
        lambda epoch: batching.epoch_steps(np.arange(len(train)), effective, s.seed, epoch), train.collate, world,
        micro, accum)
    eval_batches = [val.collate(range(i, min(i + 2 * micro, len(val)))) for i in range(0, len(val), 2 * micro)]
    prompt = sample_prompt(cfg.evaluation.sample_prompt, tok, val if len(val) else train)

    def sample(step_: int) -> dict[str, str]:
        # Rank 0 alone, on its whole replica; a sharded model's blocks are not whole on any rank.
        if not world.main or plan.parallel == "fsdp":
            return {}
        with compiler.eagerly(plan.compile):
            generated = generate_sample(model, tok, prompt, cfg.evaluation.sample_tokens or SAMPLE_TOKENS, s.seed,
                                        device, opened.autocast)
        print(f"\nsample at step {step_}: {generated!r}")
        return {"sample": generated}

    # -- train (optimizer, schedule, records, loop, evaluation and samples), then the outputs on rank 0
    identity |= {"tokenizer": blocks.tokenizer_hash(tok), "max_length": d.max_length,
                 "split": [d.split, d.validation_split, d.validation_file]}
    with runner.tracking(opened, cfg.logging) as tracking:  # closed with the run's outcome, whatever it is
        outcome, weights = runner.train_run(
            opened, plan, model, records=runner.records(opened, cfg, plan, dump_yaml, parameters=n_params),
            after_eval=sample, optimization=optimization, tracking=tracking,
            outputs=runner.Outputs.of(cfg, int(plan.value("logging_steps"))), next_micro_batch=next_micro_batch,
            eval_sets=[("validation", eval_batches)], identity=identity)
        if not world.main:
            return {}
        model.config.use_cache = True
        with atomic_files(opened.out) as tmp:  # each file whole, old or new, whenever a kill comes
            model.save_pretrained(tmp, state_dict=weights)
            tok.save_pretrained(tmp)
            saved = landing(tmp, opened.out)
        summary = summarize(cfg, opened, plan, model, outcome, n_params, measure_s) | tracking.costs()
        write_json(opened.out / "summary.json", summary)
        summary_.report(summary, opened.out)
        run_report.send(tracking, summary, opened.out, saved if cfg.logging.log_model else [])
    return summary


def summarize(cfg: PretrainRun, opened: runner.Opened, plan, model, outcome: runner.Outcome, n_params: int,
              measure_s: float) -> dict[str, Any]:
    """The run's figures (speed, MFU from the model's shape, memory, losses, batch, the last sample)."""
    matmul, layers, width = metrics.flop_dims(model)
    fpt = training_flops_per_token(matmul, n_params, layers, width, cfg.data.max_length, full=True)
    summary = {"model": type(model).__name__, "method": "pretrain", "parameters": n_params,
               **summary_.figures(outcome, fpt, opened.hw_plan, opened.hw, opened.world), "parallel": plan.parallel,
               "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
               "effective_batch_size": opened.effective, "max_length": cfg.data.max_length,
               "measure_s": round(measure_s, 3), "sample": outcome.after.get("sample")}
    return summary


SAMPLE_TOKENS = 64  # evaluation.sample_tokens' default


def check_inputs(cfg: PretrainRun) -> None:
    d = cfg.data
    for spec in cfg.data_files + ([d.validation_file] if d.validation_file else []):
        if d.train_file and not text.files(spec):
            raise TunebenchError(f"data file '{spec}' not found; check --data (data.train_file)")
    if d.tokenizer and not Path(d.tokenizer).is_dir():
        raise TunebenchError(f"data.tokenizer '{d.tokenizer}' is not a directory; point --tokenizer at the output "
                             "of `tunebench tokenizer train`")


def token_blocks(cfg: PretrainRun, tok, threads: int):
    """(training blocks, validation blocks, tokens in the corpus): the data tokenized once and cached, cut into
    blocks of data.max_length, split (or the validation file's own blocks)."""
    d = cfg.data
    threads = d.preprocessing_num_workers or threads
    cache = Path(d.cache_dir) if d.cache_dir else models.cache_dir()
    tokens = blocks.token_file(cfg.data_files, tok, cache, d.text_column, d.dataset_config, threads)
    if d.validation_file:
        valid = blocks.token_file([d.validation_file], tok, cache, d.text_column, None, threads)
        train, val = blocks.cut(tokens, d.max_length), blocks.cut(valid, d.max_length)
    else:
        train, val = blocks.split(blocks.cut(tokens, d.max_length), d.validation_split, cfg.schedule.seed, d.split)
    if d.max_eval_blocks is not None:
        val = val.subset(np.arange(min(len(val), d.max_eval_blocks)))
    if len(train) == 0:
        raise TunebenchError(f"the training data makes no block of {d.max_length} tokens; add text or lower "
                             "data.max_length")
    return train, val, len(tokens)


def model_rows(cfg: PretrainRun, model, opened: runner.Opened) -> list[Decision]:
    """The settings rows of the hardware and the model built: architecture, weights, dropout kernel."""
    rows = runner.host_rows(cfg, opened.hw_plan)
    rows.append(Decision("architecture", type(model).__name__, "learned positions: GPT-2-style"
                         if cfg.model.use_learned_pos_emb else "rotary positions, SwiGLU: Llama-style"))
    rows.append(Decision("weights", "fp32", "fp32 master weights" + (
        f"; {opened.hw_plan.precision} autocast for matmuls" if opened.autocast else "")))
    fast_drops = kernels.use_fast_dropout(model) if opened.device.type == "cpu" else 0
    if fast_drops:
        rows.append(Decision("dropout", f"fast x{fast_drops}", "16-bit random draws: a quarter of torch's CPU dropout cost"))
    if cfg.hardware.gradient_checkpointing == "on":
        enable_checkpointing(model)
    return rows


def load_or_train_tokenizer(cfg: PretrainRun):
    """The tokenizer data.tokenizer names, or a byte-level BPE trained once on the training data (cached)."""
    d = cfg.data
    if d.tokenizer:
        return models.load_tokenizer(d.tokenizer), d.tokenizer
    vocab = d.vocab_size or cfg.model.vocab_size
    key = text.fingerprint(cfg.data_files, "bpe", vocab, d.text_column, tokenizer_job.FORMAT)
    path = models.cache_dir() / "tokenizers" / key
    if not (path / "tokenizer.json").exists():
        print(f"training a byte-level BPE tokenizer ({vocab:,} tokens) on the training data (once)")
        tokenizer_job.train(cfg.data_files, vocab, "bpe", path, d.text_column, overwrite=True)  # its cache
    return models.load_tokenizer(str(path)), f"byte-level BPE trained on the data, cached in {path}"


def sample_prompt(prompt: str | None, tok, source: blocks.Blocks) -> list[int]:
    if prompt:
        return tok(prompt, add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
    return source.collate([0])["input_ids"][0, :8].tolist()


def generate_sample(model, tok, prompt: list[int], max_new_tokens: int, seed: int, device: torch.device,
                    autocast: torch.dtype | None) -> str:
    """A sampled continuation of the fixed prompt, with its own seed, generated as the model trains (under the
    run's autocast); the run's RNG and training mode are left as they were."""
    placed = inference.Placed(model, tok, device, autocast)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        ids = torch.tensor([prompt], device=device)
        room = model.config.max_position_embeddings - len(prompt)  # learned positions end there
        new = placed.decode(ids, torch.ones_like(ids), min(max_new_tokens, room), temperature=0.8, top_k=50)
    return tok.decode(prompt + new[0].tolist(), skip_special_tokens=True)
