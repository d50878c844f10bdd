"""A causal LM trained from scratch, as the pretraining recipe (jobs/pretrain.py) checks, tokenizes, builds,
samples, saves and summarizes it: its parts beside finetune_model.py, finetune_data.py and
finetune_report.py hold fine-tuning's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core.decision import Decision
from tunebench.core.durable import atomic_files, landing
from tunebench.core.errors import TunebenchError
from tunebench.data import blocks, text, tokenizer_training
from tunebench.jobs.parts import runner
from tunebench.machine import hardware, metrics
from tunebench.machine.metrics import training_flops_per_token
from tunebench.model import inference, kernels, models
from tunebench.settings.pretrain import PretrainRun
from tunebench.training import summary as summary_
from tunebench.training.autotune.probe import enable_checkpointing, memory_free_mb


def check_inputs(cfg: PretrainRun) -> None:
    d = cfg.data
    for spec in cfg.data_files + ([d.validation_file] if d.validation_file else []):
        if d.train_file and not text.files(spec):
            raise TunebenchError(f"data file '{spec}' not found; check --data (data.train_file)")
    if d.tokenizer and not Path(d.tokenizer).is_dir():
        raise TunebenchError(f"data.tokenizer '{d.tokenizer}' is not a directory; point --tokenizer at the output "
                             "of `tunebench tokenizer train`")


def load_or_train_tokenizer(cfg: PretrainRun):
    """The tokenizer data.tokenizer names, or a byte-level BPE trained once on the training data (cached)."""
    d = cfg.data
    if d.tokenizer:
        return models.load_tokenizer(d.tokenizer), d.tokenizer
    vocab = d.vocab_size or cfg.model.vocab_size
    key = text.fingerprint(cfg.data_files, "bpe", vocab, d.text_column, tokenizer_training.FORMAT)
    path = models.cache_dir() / "tokenizers" / key
    if not (path / "tokenizer.json").exists():
        print(f"training a byte-level BPE tokenizer ({vocab:,} tokens) on the training data (once)")
        tokenizer_training.train(cfg.data_files, vocab, "bpe", path, d.text_column, overwrite=True)  # its cache
    return models.load_tokenizer(str(path)), f"byte-level BPE trained on the data, cached in {path}"


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


def header(tok_source: str, tok, cfg: PretrainRun, n_tokens: int, train: blocks.Blocks, val: blocks.Blocks,
           model, n_params: int) -> str:
    """The lines above the settings table: the tokenizer, the corpus and its blocks, the model built."""
    return (f"tokenizer: {tok_source} ({len(tok):,} tokens)\ndata: {', '.join(cfg.data_files)}: {n_tokens:,} tokens, "
            f"{len(train):,} train / {len(val):,} validation blocks of {cfg.data.max_length}\n"
            f"model: {type(model).__name__}, {n_params:,} parameters")


def pick_parallel(cfg: PretrainRun, opened: runner.Opened, n_params: int) -> Decision:
    """DDP or FSDP2 under several ranks (hardware.pick_parallel), from the parameters that train: all of them."""
    world = opened.world
    return hardware.pick_parallel(cfg.distributed.parallel, "pretrain", n_params, world.size,
                                  memory_free_mb(opened.device, world.local_size))


def model_rows(cfg: PretrainRun, model, opened: runner.Opened) -> list[Decision]:
    """The settings rows of the model built (architecture, weights, dropout kernel), with the kernel and the
    checkpointing they name put on the model."""
    rows = [Decision("architecture", type(model).__name__, "learned positions: GPT-2-style"
                     if cfg.model.use_learned_pos_emb else "rotary positions, SwiGLU: Llama-style"),
            Decision("weights", "fp32", "fp32 master weights" + (
                f"; {opened.hw_plan.precision} autocast for matmuls" if opened.autocast else ""))]
    fast_drops = kernels.use_fast_dropout(model) if opened.device.type == "cpu" else 0
    if fast_drops:
        rows.append(Decision("dropout", f"fast x{fast_drops}", "16-bit random draws: a quarter of torch's CPU dropout cost"))
    if cfg.hardware.gradient_checkpointing == "on":
        enable_checkpointing(model)
    return rows


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


def save(model, tok, out: Path, weights: dict | None) -> list[Path]:
    """The model (a sharded one's gathered `weights`) and its tokenizer, each file whole, old or new, whenever a
    kill comes."""
    model.config.use_cache = True
    with atomic_files(out) as tmp:
        model.save_pretrained(tmp, state_dict=weights)
        tok.save_pretrained(tmp)
        return landing(tmp, out)


def summarize(cfg: PretrainRun, opened: runner.Opened, plan, model, outcome: summary_.Outcome, n_params: int,
              measure_s: float) -> dict[str, Any]:
    """The run's figures (speed, MFU from the model's shape, memory, losses, batch, the last sample)."""
    matmul, layers, width = metrics.flop_dims(model)
    fpt = training_flops_per_token(matmul, n_params, layers, width, cfg.data.max_length, full=True)
    return {"model": type(model).__name__, "method": "pretrain", "parameters": n_params,
            **summary_.figures(outcome, fpt, opened.hw_plan, opened.hw, opened.world), "parallel": plan.parallel,
            "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
            "effective_batch_size": opened.effective, "max_length": cfg.data.max_length,
            "measure_s": round(measure_s, 3), "sample": outcome.after.get("sample")}
