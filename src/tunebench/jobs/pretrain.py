"""`tunebench pretrain`: train a causal LM from scratch. Reads top to bottom: check the inputs, plan
the hardware, tokenizer and token blocks, build the model, decide the measured settings, train,
save. The loop, the measured decisions and the run plumbing are the ones `train` uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import arch, distributed, hardware, inference, kernels, metrics, models, optim, runner, runplan, tune
from tunebench import summary as summary_
from tunebench.data import batching, blocks, text
from tunebench.errors import TunebenchError
from tunebench.hardware import Decision
from tunebench.jobs import tokenizer as tokenizer_job
from tunebench.jsonfile import write_json
from tunebench.metrics import training_flops_per_token
from tunebench.pretrain_config import PretrainConfig, dump_yaml
from tunebench.tune import compiler
from tunebench.tune.probe import enable_checkpointing, memory_free_mb, probe_step

def run(cfg: PretrainConfig) -> dict[str, Any]:
    m, t, d = cfg.model, cfg.training, cfg.data
    out = Path(t.checkpoint_dir)
    for spec in cfg.data_files + ([d.validation_file] if d.validation_file else []):
        if d.train_file and not text.files(spec):
            raise TunebenchError(f"data file '{spec}' not found; check --data (data.train_file)")
    if d.tokenizer and not Path(d.tokenizer).is_dir():
        raise TunebenchError(f"data.tokenizer '{d.tokenizer}' is not a directory; point --tokenizer at the output "
                             "of `tunebench tokenizer train`")

    # -- the run opened: hardware plan, process group, output directory and resume point, batch, seed
    device_asked = "cpu" if t.force_cpu else t.device
    identity = {"model": cfg.to_dict()["model"], "data": cfg.data_files, "seed": t.seed}
    ask = cfg.batch_ask()
    opened = runner.open_run(out, device=device_asked, precision=precision_for(t.precision_request, device_asked),
                             compile=t.compile, threads=t.threads, backend=t.distributed_backend or t.backend,
                             resume=t.resume, overwrite=t.overwrite, identity=identity, ask=ask, seed=t.seed)
    hw, hw_plan, world, device = opened.hw, opened.hw_plan, opened.world, opened.device
    effective, resumed, autocast = opened.effective, opened.resumed, opened.autocast

    # -- tokenizer and token blocks (tokenized once, cached, memory-mapped)
    with distributed.local_rank0_first(world):  # each machine's first rank fills the caches
        tok, tok_source = load_or_train_tokenizer(cfg)
        arch.check_vocab(m, tok)
        threads = d.preprocessing_num_workers or hw_plan.threads
        cache = Path(d.cache_dir) if d.cache_dir else models.cache_dir()
        tokens = blocks.token_file(cfg.data_files, tok, cache, d.text_column, d.dataset_config, threads)
        valid = blocks.token_file([d.validation_file], tok, cache, d.text_column, None, threads) \
            if d.validation_file else None
    if valid is not None:
        train, val = blocks.cut(tokens, d.max_length), blocks.cut(valid, d.max_length)
    else:
        train, val = blocks.split(blocks.cut(tokens, d.max_length), d.validation_split, t.seed, d.split)
    if d.max_eval_blocks is not None:
        val = val.subset(np.arange(min(len(val), d.max_eval_blocks)))
    if len(train) == 0:
        raise TunebenchError(f"the training data makes no block of {d.max_length} tokens; add text or lower "
                             "data.max_length")

    # -- model
    model = arch.build(m, tok, t.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    fast_drops = kernels.use_fast_dropout(model) if device.type == "cpu" else 0
    pin = bool(hw_plan.value("pin_memory")) and t.dataloader_pin_memory
    rows = [dd if dd.setting != "pin_memory" or pin == dd.value
            else Decision("pin_memory", False, "training.dataloader_pin_memory: false")
            for dd in hw_plan.decisions if dd.setting != "compile"]
    rows.append(Decision("architecture", type(model).__name__, "learned positions: GPT-2-style"
                         if m.use_learned_pos_emb else "rotary positions, SwiGLU: Llama-style"))
    rows.append(Decision("weights", "fp32", "fp32 master weights" + (f"; {hw_plan.precision} autocast for matmuls"
                                                                     if autocast else "")))
    if fast_drops:
        rows.append(Decision("dropout", f"fast x{fast_drops}",
                             "16-bit random draws: a quarter of torch's CPU dropout cost"))
    if m.gradient_checkpointing:
        enable_checkpointing(model)
    rows.append(Decision("dataloader", "in-process", "a batch is a slice of the memory-mapped token file"
                         + (f"; dataloader_num_workers {t.dataloader_num_workers} not needed"
                            if t.dataloader_num_workers else "")
                         + (f"; dataloader_prefetch_factor {t.dataloader_prefetch_factor} not needed: nothing to "
                            "prefetch" if t.dataloader_prefetch_factor else "")))
    if t.force_cpu:
        rows.insert(0, Decision("force_cpu", True, f"training.force_cpu: the CPU, whatever device '{t.device}' says"))

    # -- measured decisions: attention kernel, micro batch (the effective batch stays fixed), compile.
    # Rank 0 measures; the other ranks take its answers (ranks never disagree, never race on the cache).
    steps = runplan.total_steps(len(train), effective, t.num_epochs, t.max_steps, t.max_tokens, d.max_length)
    parallel = hardware.pick_parallel(t.parallel, "pretrain", n_params, world.size,
                                      memory_free_mb(device, world.local_size))
    checkpointing = "on" if m.gradient_checkpointing else "off"

    def measure() -> runplan.Measured:
        shape = tune.Shape(f"pretrain:{arch.fingerprint(m)}", "pretrain", "none", None, None, d.max_length,
                           tune.where(hw, hw_plan, device), hw_plan.precision, hw.versions.get("torch", ""),
                           t.attention, "off", checkpointing)
        step = probe_step(model, lambda size: train.collate(range(min(size, len(train)))), device, autocast)
        return runplan.measure(
            model, step, shape, world_size=world.size, device=device, precision=hw_plan.precision,
            attention_asked=t.attention, attention_rows=t.batch_size, widest=d.max_length, effective=effective,
            resumed=resumed, micro_asked=ask.micro, asked_reason="training.batch_size", n_train=len(train),
            max_length=d.max_length, checkpointing=checkpointing,
            compile_asked=runner.compile_decision(hw_plan, parallel.value), compile_mode=t.compile_mode, quantized=False,
            run_tokens=steps * effective * d.max_length, local_ranks=world.local_size)

    measured, measure_s = runner.measured_by_rank0(world, model, measure)
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    warmup = t.warmup_steps or int(t.warmup_ratio * steps)
    plan = runplan.make(hw_plan, world, parallel, measured, effective, accum, steps, [
        *rows, Decision("world", world.size, world.describe()), parallel, *measured.decisions,
        optim.optimizer_row(device, t.weight_decay),
        runplan.batch_row(effective, micro, accum, world.size, f" blocks of {d.max_length}"),
        Decision("lr", f"{t.learning_rate:g}", f"{t.lr_scheduler} after {warmup} warm-up steps"),
        Decision("total_steps", steps, "training.max_steps" if t.max_steps
                 else f"training.max_tokens {t.max_tokens:,} in blocks of {d.max_length}" if t.max_tokens
                 else f"{t.num_epochs:g} epoch(s) of {len(train)} blocks")])
    if world.main:
        print(f"tokenizer: {tok_source} ({len(tok):,} tokens)")
        print(f"data: {', '.join(cfg.data_files)}: {len(tokens):,} tokens, {len(train):,} train / {len(val):,} "
              f"validation blocks of {d.max_length}")
        print(f"model: {type(model).__name__}, {n_params:,} parameters")
        summary_.print_plan(plan.decisions)

    # -- batches: each epoch's optimizer steps of blocks (seed, epoch, effective batch), this rank's share of each
    next_micro_batch = runner.micro_batches(
        lambda epoch: batching.epoch_steps(np.arange(len(train)), effective, t.seed, epoch), train.collate, world,
        micro, accum)
    eval_batches = [val.collate(range(i, min(i + 2 * micro, len(val)))) for i in range(0, len(val), 2 * micro)]
    prompt = sample_prompt(t.sample_prompt, tok, val if len(val) else train)

    def sample(step_: int) -> dict[str, str]:
        # Rank 0 alone, on its whole replica; a sharded model's blocks are not whole on any rank.
        if not world.main or plan.parallel == "fsdp":
            return {}
        with compiler.eagerly(plan.compile):
            generated = generate_sample(model, tok, prompt, t.sample_tokens, t.seed, device, autocast)
        print(f"\nsample at step {step_}: {generated!r}")
        return {"sample": generated}

    def records() -> None:
        dump_yaml(cfg, out / "config.yaml")
        write_json(out / "plan.json", {"hardware": hw.to_dict(), "decisions": plan.to_json(), "parameters": n_params})

    # -- train (optimizer, schedule, records, loop, evaluation and samples), then the outputs on rank 0
    identity |= {"tokenizer": blocks.tokenizer_hash(tok), "max_length": d.max_length,
                 "split": [d.split, d.validation_split, d.validation_file]}
    outcome, weights = runner.train_run(
        out, opened, plan, model, autocast, seed=t.seed, records=records, after_eval=sample,
        optimization=runner.Optimization(t.learning_rate, t.weight_decay, t.lr_scheduler, warmup, t.max_grad_norm,
                                         (t.adam_beta1, t.adam_beta2)),
        outputs=runner.Outputs(t.logging_steps, t.eval_steps, t.save_steps, t.save_total_limit, t.progress,
                               t.report_to, t.monitor, t.logging_dir),
        next_micro_batch=next_micro_batch, eval_sets=[("validation", eval_batches)], identity=identity,
        pin_memory=pin)
    if not world.main:
        return {}
    model.config.use_cache = True
    model.save_pretrained(out, state_dict=weights)
    tok.save_pretrained(out)
    matmul, layers, width = metrics.flop_dims(model)
    fpt = training_flops_per_token(matmul, n_params, layers, width, d.max_length, full=True)
    summary = {"model": type(model).__name__, "method": "pretrain", "parameters": n_params,
               **summary_.figures(outcome, fpt, hw_plan, hw, world), "parallel": plan.parallel,
               "micro_batch_size": micro, "grad_accum_steps": accum,
               "effective_batch_size": effective, "max_length": d.max_length, "measure_s": round(measure_s, 3),
               "sample": outcome.after.get("sample")}
    write_json(out / "summary.json", summary)
    summary_.report(summary, out)
    return summary


def precision_for(request: str, device: str, hw: hardware.Hardware | None = None) -> str:
    """The --precision a run asks hardware.plan for; `use_amp: true` wants 16-bit and refuses fp32."""
    if request != "amp":
        return request
    auto = hardware.plan(device, "auto", hw or hardware.detect()).precision
    if auto == "fp32":
        raise TunebenchError("training.use_amp: true, but this device has no fast 16-bit arithmetic (a CPU without "
                             "AVX512-BF16 or AMX); set use_amp: false (fp32)")
    return auto


def load_or_train_tokenizer(cfg: PretrainConfig):
    """The tokenizer data.tokenizer names, or a byte-level BPE trained once on the training data (cached)."""
    d = cfg.data
    if d.tokenizer:
        return models.load_tokenizer(d.tokenizer), d.tokenizer
    vocab = d.vocab_size or cfg.model.vocab_size
    key = text.fingerprint(cfg.data_files, "bpe", vocab, d.text_column, tokenizer_job.FORMAT)
    path = models.cache_dir() / "tokenizers" / key
    if not (path / "tokenizer.json").exists():
        print(f"training a byte-level BPE tokenizer ({vocab:,} tokens) on the training data (once)")
        tokenizer_job.train(cfg.data_files, vocab, "bpe", path, d.text_column)
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
        outputs = placed.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=min(max_new_tokens, room), do_sample=True, temperature=0.8,
                                  top_k=50, use_cache=True, pad_token_id=tok.pad_token_id)
    return tok.decode(outputs[0].tolist(), skip_special_tokens=True)
