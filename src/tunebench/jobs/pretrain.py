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
from tunebench.data import batching, blocks, text
from tunebench.jobs import run_report
from tunebench.jobs import tokenizer as tokenizer_job
from tunebench.machine import distributed, hardware, metrics
from tunebench.machine.hardware import Decision
from tunebench.machine.metrics import training_flops_per_token
from tunebench.model import arch, inference, kernels, models
from tunebench.settings.pretrain import PretrainConfig, PretrainRun, dump_yaml, validate
from tunebench.training import recipe, runner, runplan
from tunebench.training import summary as summary_
from tunebench.training.tune import compiler
from tunebench.training.tune.probe import enable_checkpointing, memory_free_mb


def run(cfg: PretrainRun | PretrainConfig) -> dict[str, Any]:
    cfg = validate(cfg)  # the CPU guide's trio becomes the run it describes
    m, d, s = cfg.model, cfg.data, cfg.schedule
    check_inputs(cfg)
    identity = {"model": cfg.to_dict()["model"], "data": cfg.data_files, "seed": s.seed}
    opened = runner.open_run(cfg, identity)
    world, device = opened.world, opened.device
    with distributed.local_rank0_first(world):  # tokenized once, cached, memory-mapped by each machine's first rank
        tok, tok_source = load_or_train_tokenizer(cfg)
        arch.check_vocab(m, tok)
        train, val, n_tokens = token_blocks(cfg, tok, opened.hw_plan.threads)
    model = arch.build(m, tok, s.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    prompt = sample_prompt(cfg.evaluation.sample_prompt, tok, val if len(val) else train)

    def sample(plan, step: int) -> dict[str, str]:
        # Rank 0 alone, on its whole replica; a sharded model's blocks are not whole on any rank.
        if not world.main or plan.parallel == "fsdp":
            return {}
        with compiler.eagerly(plan.compile):
            generated = generate_sample(model, tok, prompt, cfg.evaluation.sample_tokens or SAMPLE_TOKENS, s.seed,
                                        device, opened.autocast)
        print(f"\nsample at step {step}: {generated!r}")
        return {"sample": generated}

    def finish(done: recipe.Finished):
        model.config.use_cache = True
        with atomic_files(opened.out) as tmp:  # each file whole, old or new, whenever a kill comes
            model.save_pretrained(tmp, state_dict=done.weights)
            tok.save_pretrained(tmp)
            saved = landing(tmp, opened.out)
        return summarize(cfg, opened, done.plan, model, done.outcome, n_params, done.measure_s), saved

    blocks_of = f"blocks of {d.max_length}"
    return recipe.train(cfg, opened, recipe.Recipe(
        model=model, loss=None, rows=model_rows(cfg, model, opened), method_rows=[],
        header=f"tokenizer: {tok_source} ({len(tok):,} tokens)\ndata: {', '.join(cfg.data_files)}: {n_tokens:,} "
               f"tokens, {len(train):,} train / {len(val):,} validation {blocks_of}\n"
               f"model: {type(model).__name__}, {n_params:,} parameters",
        parallel=hardware.pick_parallel(cfg.distributed.parallel, "pretrain", n_params, world.size,
                                        memory_free_mb(device, world.local_size)),
        n_train=len(train), unit=blocks_of, tokens_per_unit=d.max_length,
        what=(f"pretrain:{arch.fingerprint(m)}", "pretrain", "none", None, None),
        probe_rows=lambda size: train.collate(range(min(size, len(train)))), widest=d.max_length,
        max_length=d.max_length, attention_rows=opened.ask.micro or runplan.ATTENTION_ROWS, asked_reason="training.batch_size",
        batches=lambda micro: (lambda epoch: batching.epoch_steps(np.arange(len(train)), opened.effective, s.seed,
                                                                  epoch), train.collate, []),
        eval_sets=lambda micro: [("validation", [val.collate(range(i, min(i + 2 * micro, len(val))))
                                                 for i in range(0, len(val), 2 * micro)])],
        identity=identity | {"tokenizer": blocks.tokenizer_hash(tok), "max_length": d.max_length,
                             "split": [d.split, d.validation_split, d.validation_file]},
        dump=dump_yaml, finish=finish, publish=run_report.send, records={"parameters": n_params},
        batch_unit=f" {blocks_of}", after_eval=sample))


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
