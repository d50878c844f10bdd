"""`tunebench train`: LoRA, QLoRA or full fine-tuning of a causal LM. Reads top to bottom:
plan the hardware, load model and data, set up the method, decide the measured settings, train, save."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import hardware, models, optim, runner, tune
from tunebench.config import RunConfig, dump_yaml, replace
from tunebench.data import batching, formats
from tunebench.data.tokenize import load_tokenized, split
from tunebench.errors import TunebenchError
from tunebench.jsonfile import write_json
from tunebench.loop import DTYPES, LoopSettings, LoopState, evaluate
from tunebench.metrics import training_flops_per_token
from tunebench.tune import attention, batch, compiler, layout
from tunebench.tune.probe import enable_checkpointing, probe_step

def build_model(cfg: RunConfig, loaded: models.Loaded, precision: str, device: torch.device):
    """Apply the method. Returns (model, autocast dtype, reasons). Frozen bases live in the compute dtype."""
    a = cfg.adapter
    compute = DTYPES[precision]
    rows: list[tuple[str, Any, str]] = []
    model = loaded.model
    if a.method == "full":
        rows.append(models.apply_liger(model, cfg.train.liger, device.type))
        model.to(device)
        autocast = None if precision == "fp32" else compute
        rows.append(("weights", "fp32", "full fine-tuning keeps fp32 master weights" +
                     (f"; {precision} autocast for matmuls" if autocast else "")))
        return model, autocast, rows
    if a.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = models.load_quantized(loaded, cfg.model.name, a.quantization, compute, cfg.model.allow_download)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        rows.append(("base weights", a.quantization, f"bitsandbytes {'nf4 + double quant' if a.quantization == '4bit' else 'LLM.int8'}, compute in {precision}"))
    else:
        model.to(dtype=compute)
        rows.append(("base weights", precision, "the run's precision" if precision == "fp32"
                     else "frozen: no fp32 master copy needed"))
    rows.append(models.apply_liger(model, cfg.train.liger, device.type))  # on the base, before the adapters
    modules, why = models.target_modules(model, a.target_modules)
    rows.append(("target_modules", ",".join(modules) if isinstance(modules, list) else modules, why))
    model = models.add_lora(model, a.r, a.lora_alpha, a.lora_dropout, modules)
    model.to(device)
    if a.method == "lora" and precision != "fp32":
        models.compute_adapters_in(model)
        rows.append(("adapters", f"fp32 + {precision} autocast", "fp32 master weights, low-precision matmuls: "
                                                                  "no fp32 copies of activations per LoRA layer"))
        return model, compute, rows
    rows.append(("adapters", "fp32", "fp32 weights and compute"))
    return model, None, rows


def run(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    out = Path(t.output_dir)

    # -- every input checked before anything expensive: data, model, output directory, checkpoint
    if t.autotune_batch and t.grad_accum_steps is not None:
        raise TunebenchError("--batch-size auto derives --grad-accum from --effective-batch-size; drop --grad-accum")
    examples = formats.load_examples(cfg.data)
    if examples.empty_rows:
        print(f"data: {examples.describe_dropped()}")
    check_rows(len(examples.messages), cfg, len(examples.empty_rows), "empty")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    runner.prepare_output_dir(out, t.resume, t.overwrite)
    identity = {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "data": cfg.data.path, "seed": t.seed}
    resume_from = runner.resume_point(t.resume, out, identity)

    # -- hardware plan
    hw = hardware.detect()
    plan = hardware.plan(t.device, t.precision, hw, t.compile, t.threads)
    device = torch.device(plan.device)
    runner.apply_plan(plan)
    runner.seed_everything(t.seed)

    # -- model and data
    loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download)
    tok = loaded.tokenizer
    data = load_tokenized(cfg.data, tok, models.cache_dir(), examples)
    check_rows(len(data), cfg, data.dropped, "left without a response by truncation at --max-length")
    train_idx, eval_idx = split(len(data), cfg.data.eval_fraction, t.seed, cfg.data.max_samples, cfg.data.eval_samples)
    limit = models.position_limit(loaded.model)
    if limit is not None and cfg.data.max_length > limit:
        raise TunebenchError(f"--max-length {cfg.data.max_length} exceeds the {limit} positions this model learned; "
                             f"pass --max-length {limit} or less")
    model, autocast, method_rows = build_model(cfg, loaded, plan.precision, device)
    model.config.use_cache = False
    trainable, total = models.count_parameters(model)
    if trainable == 0:
        raise TunebenchError("nothing to train: no parameter requires a gradient; check --method and --target-modules")

    # -- measured decisions: attention kernel, micro batch (the effective batch stays fixed), compile, layout
    rows: list[tuple[str, Any, str]] = []
    if t.gradient_checkpointing == "on":
        enable_checkpointing(model)
        rows.append(("gradient_checkpointing", True, "asked for"))
    lengths = data.lengths()
    longest = sorted(train_idx.tolist(), key=lambda i: -lengths[i])
    step = probe_step(model, lambda size: batching.collate(data, longest[:size], tok.pad_token_id), device, autocast)
    shape = tune.Shape(cfg.model.name, cfg.adapter.method, cfg.adapter.quantization, cfg.adapter.r,
                       cfg.adapter.target_modules, cfg.data.max_length, tune.where(hw, plan, device), plan.precision,
                       hw.versions.get("torch", ""), t.attention, t.liger, t.gradient_checkpointing)
    rows_probed = min(t.micro_batch_size, len(train_idx))
    # Packed rows fill max_length, so a kernel must fit that, not just the longest example.
    widest = cfg.data.max_length if cfg.data.packing != "off" else int(lengths[train_idx].max())
    rows.append(attention.decide(model, t.attention, lambda: step(rows_probed)[0], shape, rows_probed, widest,
                                 plan.precision, device))
    probed_speed = None  # tokens/s of the chosen micro batch, when the batch probe measured it
    if t.autotune_batch:
        micro, batch_rows, probed_speed = batch.micro_batch(step, shape, t.effective_batch_size, len(train_idx),
                                                            cfg.data.max_length, device)
        cfg = replace(cfg, **{"train.micro_batch_size": micro})
        t = cfg.train
        rows += batch_rows
    else:
        rows.append(("micro_batch_size", t.micro_batch_size, "asked for"))
    if t.gradient_checkpointing == "auto" and not any(r[0] == "gradient_checkpointing" for r in rows):
        rows.append(("gradient_checkpointing", False, "the batch fits without recomputation"))
    accum = cfg.grad_accum_steps
    batch_layout, layout_reason = layout.decide(cfg.data.packing, lengths, train_idx, t.micro_batch_size, t.seed,
                                                cfg.data.max_length)
    rows.append(("batch layout", batch_layout, layout_reason))
    lr, lr_reason = scaled_lr(t.lr, cfg.effective_batch_size, t.lr_scaling, t.lr_reference_batch)
    micro_per_epoch = math.ceil(len(train_idx) / t.micro_batch_size)
    total_steps = t.max_steps or max(1, math.ceil(t.epochs * micro_per_epoch / accum))
    run_tokens = total_steps * cfg.effective_batch_size * float(np.mean(lengths[train_idx]))
    compile_row = compiler.pick(model, plan.decision("compile"), cfg.adapter.method == "qlora",
                               lambda: step(t.micro_batch_size)[0], run_tokens, shape, t.micro_batch_size,
                               probed_speed)
    compiled = bool(compile_row[1])
    planned = [(d.setting, d.value, d.reason) for d in plan.decisions if d.setting != "compile"]
    rows = planned + method_rows + rows + [
        compile_row,
        optim.optimizer_row(device, t.weight_decay),
        ("grad_accum_steps", accum, f"effective batch {cfg.effective_batch_size} = {t.micro_batch_size} x {accum}"),
        ("lr", f"{lr:g}", lr_reason),
        ("total_steps", total_steps, "--max-steps" if t.max_steps else f"{t.epochs:g} epoch(s) of {len(train_idx)} rows"),
    ]
    print(f"model: {loaded.source}")
    print(f"data: {cfg.data.path} ({data.fmt}), {len(train_idx)} train / {len(eval_idx)} eval rows"
          + (f"; {data.dropped} of {len(data) + data.dropped} rows dropped: no response left after truncation"
             if data.dropped else ""))
    print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")
    runner.print_plan(rows)

    # -- optimizer, schedule, records
    optimizer = optim.adamw(model, lr, t.weight_decay, device)
    scheduler = optim.scheduler(optimizer, t.schedule, int(t.warmup_ratio * total_steps), total_steps)
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None
    identity |= {"micro_batch_size": t.micro_batch_size, "grad_accum_steps": accum}
    dump_yaml(cfg, out / "config.yaml")
    write_json(out / "plan.json", {"hardware": hw.to_dict(), "decisions": [
        {"setting": s, "value": v, "reason": r} for s, v, r in rows], "trainable_parameters": trainable,
        "total_parameters": total, "model_source": loaded.source})

    # -- batches
    packing = batch_layout == "packed"
    group_lengths = lengths if batch_layout == "length-grouped" else None
    epochs: dict[int, list[list[int]]] = {}

    def next_micro_batch(s: LoopState):
        order = epochs.setdefault(
            s.epoch, batching.epoch_order(train_idx, t.micro_batch_size, t.seed, s.epoch, lengths=group_lengths))
        if s.batch_in_epoch >= len(order):
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
            return next_micro_batch(s)
        rows_ = order[s.batch_in_epoch]
        s.batch_in_epoch += 1
        if packing:
            return batching.collate_packed(data, rows_, tok.pad_token_id, cfg.data.max_length)
        return batching.collate(data, rows_, tok.pad_token_id)

    eval_batches = batching.eval_batches(data, eval_idx, t.micro_batch_size * 2, tok.pad_token_id)

    def run_eval() -> dict[str, float]:
        with compiler.eagerly(compiled):
            return evaluate(model, eval_batches, device, autocast)

    # -- train
    settings = LoopSettings(
        total_steps=total_steps, grad_accum_steps=accum, max_grad_norm=t.max_grad_norm, device=device,
        autocast_dtype=autocast, logging_steps=t.logging_steps, eval_steps=t.eval_steps,
        save_steps=t.save_steps, progress=t.progress, pin_memory=bool(plan.value("pin_memory")),
    )
    outcome = runner.run_loop(out, model, optimizer, scheduler, scaler, next_micro_batch,
                              run_eval if eval_batches else None, settings, identity, resume_from, t.save_total_limit,
                              t.report_to, t.monitor, probed_tokens_per_s=probed_speed)

    # -- outputs
    save_final(model, tok, out, cfg, loaded)
    matmul, layers, width = models.flop_dims(model)
    state = outcome.state
    # Attention over each example's own length (token-weighted), not the packed row's width.
    fpt = training_flops_per_token(matmul, trainable, layers, width, state.token_sq / max(state.tokens, 1),
                                   cfg.adapter.method == "full")
    summary = {
        "model": cfg.model.name, "method": cfg.adapter.method, "quantization": cfg.adapter.quantization,
        **runner.figures(outcome, fpt, plan, hw),
        "trainable_parameters": trainable, "micro_batch_size": t.micro_batch_size, "grad_accum_steps": accum,
        "effective_batch_size": cfg.effective_batch_size, "max_length": cfg.data.max_length,
    }
    write_json(out / "summary.json", summary)
    runner.report(summary, out)
    return summary


def check_rows(usable: int, cfg: RunConfig, dropped: int, why: str) -> None:
    """Refuse data too small for one optimizer step: fewer training rows than the effective batch would
    repeat rows inside a step (one row trained 8 times as one 'batch' of 8)."""
    d = cfg.data
    train_idx, eval_idx = split(usable, d.eval_fraction, cfg.train.seed, d.max_samples, d.eval_samples)
    if len(train_idx) < cfg.effective_batch_size:
        held = f", {len(eval_idx)} held out for eval" if len(eval_idx) else ""
        lost = f", {dropped} {why}" if dropped else ""
        raise TunebenchError(
            f"dataset '{d.path}' leaves {len(train_idx)} training row(s) ({usable} usable{lost}{held}), fewer than one "
            f"effective batch of {cfg.effective_batch_size}; add rows or lower --effective-batch-size")


def save_final(model, tokenizer, out: Path, cfg: RunConfig, loaded: models.Loaded) -> None:
    if cfg.adapter.method == "full":
        model.save_pretrained(out)
    else:
        model.peft_config["default"].base_model_name_or_path = loaded.path or cfg.model.name
        model.save_pretrained(out, save_embedding_layers=False)  # "auto" would look the base up on the hub
    tokenizer.save_pretrained(out)


def scaled_lr(lr: float, effective: int, rule: str, reference: int) -> tuple[float, str]:
    if rule == "none" or effective == reference:
        return lr, "not scaled (--lr-scaling none)" if rule == "none" else f"effective batch is the reference {reference}"
    factor = effective / reference if rule == "linear" else math.sqrt(effective / reference)
    return lr * factor, f"{rule} scaling: {lr:g} x {factor:.3g} for effective batch {effective} vs {reference}"
