"""`tunebench train`: LoRA, QLoRA or full fine-tuning of a causal LM. Reads top to bottom:
plan the hardware, load model and data, set up the method, train, save."""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import autotune, checkpoint, hardware, kernels, models
from tunebench.config import RunConfig, dump_yaml, replace
from tunebench.data import batching
from tunebench.data.tokenize import Tokenized, load_tokenized, split
from tunebench.errors import TunebenchError
from tunebench.loop import Hooks, LoopSettings, LoopState, evaluate, loss_sum, prepare, train
from tunebench.metrics import (MetricsWriter, mfu, peak_memory_mb, reset_peak_memory, training_flops_per_token,
                               write_json)
from tunebench.monitor import Monitor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_plan(rows: list[tuple[str, Any, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    value_width = min(22, max(len(str(r[1])) for r in rows))
    print("settings:")
    for setting, value, reason in rows:
        print(f"  {setting:<{width}}  {value!s:<{value_width}}  {reason}")


def prepare_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TunebenchError(f"cannot write to --output-dir '{path}' ({e.strerror}); pick a writable directory") from e


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 1 - progress) if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


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


def fused_adamw(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu")


def optimizer_row(device: torch.device) -> tuple[str, Any, str]:
    if fused_adamw(device):
        return ("optimizer", "AdamW, fused", "one kernel for all parameters; on a CPU 5x faster than foreach "
                                             "(80 vs 407 ms a step for 135M fp32 weights)")
    return ("optimizer", "AdamW, foreach", f"tunebench uses torch's fused AdamW on CUDA and CPU, not {device.type}")


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, device: torch.device):
    """AdamW, fused where torch has the kernel: the optimizer step of full fine-tuning on a CPU runs
    about 5x faster than the default foreach path (80 vs 407 ms for SmolLM2's 135M fp32 weights)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused_adamw(device) or None)


def apply_plan(plan: hardware.Plan) -> None:
    torch.set_num_threads(plan.threads)
    if plan.device == "cuda":
        tf32 = bool(plan.value("tf32"))
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = bool(plan.value("cudnn_benchmark"))


def claim_output_dir(out: Path, resume: str | None, overwrite: bool) -> None:
    """A fresh run never silently replaces an earlier run's checkpoints and records."""
    earlier = [p for p in (out / "checkpoints", out / "metrics.jsonl", out / "summary.json") if p.exists()]
    if not earlier or resume:
        return
    if not overwrite:
        raise TunebenchError(
            f"--output-dir '{out}' already holds a run ({earlier[0].name}); continue it with --resume auto, "
            "replace it with --overwrite, or pick another --output-dir"
        )
    for p in earlier:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def run(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    out = Path(t.output_dir)
    prepare_output_dir(out)
    claim_output_dir(out, t.resume, t.overwrite)

    # -- hardware plan
    hw = hardware.detect()
    plan = hardware.plan(t.device, t.precision, hw, t.compile)
    device = torch.device(plan.device)
    apply_plan(plan)
    seed_everything(t.seed)

    # -- model and data
    loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download)
    tok = loaded.tokenizer
    data = load_tokenized(cfg.data, tok, models.cache_dir())
    train_idx, eval_idx = split(len(data), cfg.data.eval_fraction, t.seed, cfg.data.max_samples, cfg.data.eval_samples)
    if len(train_idx) == 0:
        raise TunebenchError(f"no training rows left after the eval split of {len(data)} rows; add data or lower --eval-fraction")
    model, autocast, method_rows = build_model(cfg, loaded, plan.precision, device)
    model.config.use_cache = False
    trainable, total = models.count_parameters(model)
    if trainable == 0:
        raise TunebenchError("nothing to train: no parameter requires a gradient; check --method and --target-modules")

    # -- batch: measured (--batch-size auto) or as given; the effective batch stays fixed
    batch_rows: list[tuple[str, Any, str]] = []
    probed_speed = None  # tokens/s of the chosen micro batch, when the batch probe measured it
    if t.gradient_checkpointing == "on":
        enable_checkpointing(model)
        batch_rows.append(("gradient_checkpointing", True, "asked for"))
    step = probe_step(model, data, train_idx, tok.pad_token_id, device, autocast)
    where = hw.gpus[0].name if device.type == "cuda" else f"{hw.cpu_model} x{plan.threads}"
    key = "|".join(map(str, (cfg.model.name, cfg.adapter.method, cfg.adapter.quantization, cfg.adapter.r,
                             cfg.adapter.target_modules, cfg.data.max_length, where, plan.precision,
                             hw.versions.get("torch"))))
    rows_probed = min(t.micro_batch_size, len(train_idx))
    # Packed rows fill max_length, so a kernel must fit that, not just the longest example.
    widest = cfg.data.max_length if cfg.data.packing != "off" else int(data.lengths()[train_idx].max())
    batch_rows.append(pick_attention(model, t.attention, lambda: step(rows_probed)[0], key,
                                     attention_fit(model, rows_probed, widest, plan.precision, device),
                                     candidates=attention_candidates(device, plan.precision)))
    if t.autotune_batch:
        cfg, tuned_rows, probed_speed = autotune_batch(cfg, step, len(train_idx), device, key)
        t = cfg.train
        batch_rows += tuned_rows
    else:
        batch_rows.append(("micro_batch_size", t.micro_batch_size, "asked for"))
    if t.gradient_checkpointing == "auto" and not any(r[0] == "gradient_checkpointing" for r in batch_rows):
        batch_rows.append(("gradient_checkpointing", False, "the batch fits without recomputation"))
    accum = cfg.grad_accum_steps
    layout, layout_reason = decide_layout(cfg.data.packing, data, train_idx, t.micro_batch_size, t.seed,
                                          cfg.data.max_length)
    batch_rows.append(("batch layout", layout, layout_reason))
    packing = layout == "packed"
    group_lengths = data.lengths() if layout == "length-grouped" else None
    lr, lr_reason = scaled_lr(t.lr, cfg.effective_batch_size, t.lr_scaling, t.lr_reference_batch)
    micro_per_epoch = math.ceil(len(train_idx) / t.micro_batch_size)
    total_steps = t.max_steps or max(1, math.ceil(t.epochs * micro_per_epoch / accum))
    run_tokens = total_steps * cfg.effective_batch_size * float(np.mean(data.lengths()[train_idx]))
    compile_row = pick_compile(model, plan.decision("compile"), cfg.adapter.method == "qlora",
                               lambda: step(t.micro_batch_size)[0], run_tokens, f"{key}|{t.micro_batch_size}",
                               probed_speed)
    compiled = bool(compile_row[1])
    planned = [(d.setting, d.value, d.reason) for d in plan.decisions if d.setting != "compile"]
    rows = planned + method_rows + batch_rows + [
        compile_row,
        optimizer_row(device),
        ("grad_accum_steps", accum, f"effective batch {cfg.effective_batch_size} = {t.micro_batch_size} x {accum}"),
        ("lr", f"{lr:g}", lr_reason),
        ("total_steps", total_steps, "--max-steps" if t.max_steps else f"{t.epochs:g} epoch(s) of {len(train_idx)} rows"),
    ]
    print(f"model: {loaded.source}")
    print(f"data: {cfg.data.path} ({data.fmt}), {len(train_idx)} train / {len(eval_idx)} eval rows"
          + (f"; {data.dropped} of {len(data) + data.dropped} rows dropped: no response left after truncation"
             if data.dropped else ""))
    print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")
    print_plan(rows)

    # -- optimizer and schedule
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr, t.weight_decay, device)
    warmup = int(t.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.schedule, warmup, total_steps))
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None

    # -- records
    identity = {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "data": cfg.data.path,
                "micro_batch_size": t.micro_batch_size, "grad_accum_steps": accum, "seed": t.seed}
    dump_yaml(cfg, out / "config.yaml")
    write_json(out / "plan.json", {"hardware": hw.to_dict(), "decisions": [
        {"setting": s, "value": v, "reason": r} for s, v, r in rows], "trainable_parameters": trainable,
        "total_parameters": total, "model_source": loaded.source})

    state = LoopState()
    ckpt_root = out / "checkpoints"
    if t.resume:
        found = checkpoint.find(t.resume, ckpt_root)
        if found is None:
            print(f"resume: no checkpoint under {ckpt_root}; starting from step 0")
        else:
            state = checkpoint.load(found, model, optimizer, scheduler, identity, scaler)
            print(f"resume: continuing from {found} (step {state.step})")

    def collate_train(batch: list[int]) -> dict[str, torch.Tensor]:
        if packing:
            return batching.collate_packed(data, batch, tok.pad_token_id, cfg.data.max_length)
        return batching.collate(data, batch, tok.pad_token_id)

    epoch_cache: dict[int, list[list[int]]] = {}

    def next_micro_batch(s: LoopState):
        order = epoch_cache.setdefault(
            s.epoch, batching.epoch_order(train_idx, t.micro_batch_size, t.seed, s.epoch, lengths=group_lengths))
        if s.batch_in_epoch >= len(order):
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
            return next_micro_batch(s)
        batch = order[s.batch_in_epoch]
        s.batch_in_epoch += 1
        return collate_train(batch)

    eval_batches = batching.eval_batches(data, eval_idx, t.micro_batch_size * 2, tok.pad_token_id)
    metrics = MetricsWriter(out / "metrics.jsonl", out / "tensorboard" if t.report_to == "tensorboard" else None)

    stop = {"requested": False}

    def on_signal(signum, frame):
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step (again to abort)")

    def save(s: LoopState):
        path = checkpoint.save(ckpt_root, model, optimizer, scheduler, s, identity, t.save_total_limit, scaler)
        metrics({"step": s.step, "checkpoint": str(path)})

    def run_eval() -> dict[str, float]:
        # Eagerly: a compiled no-grad graph would cost a second warm-up for a few batches.
        with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext():
            return evaluate(model, eval_batches, device, autocast)

    hooks = Hooks(
        log=metrics,
        evaluate=(lambda step: run_eval()) if eval_batches else None,
        save=save,
        should_stop=lambda: stop["requested"],
    )
    settings = LoopSettings(
        total_steps=total_steps, grad_accum_steps=accum, max_grad_norm=t.max_grad_norm, device=device,
        autocast_dtype=autocast, logging_steps=t.logging_steps, eval_steps=t.eval_steps,
        save_steps=t.save_steps, progress=t.progress,
    )
    before = run_eval() if eval_batches and state.step == 0 else None
    if before:
        metrics({"step": 0, **before})
        print(f"eval before training: loss {before['eval_loss']:.4f}, perplexity {before['perplexity']:.2f}")
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    monitor = Monitor(out / "monitor.jsonl" if t.monitor else None,
                      gpu_indices=(device.index or 0,) if device.type == "cuda" else ())
    wall = time.perf_counter()
    try:
        reset_peak_memory(device)  # the summary's peak is the training loop's, not a probe's or the loading's
        with monitor:
            state = train(model, optimizer, scheduler, next_micro_batch, state, settings, hooks, scaler)
        if not (t.save_steps and state.step % t.save_steps == 0):  # the loop did not just save it
            save(state)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        metrics.close()
    wall = time.perf_counter() - wall

    # -- final eval and outputs
    after = run_eval() if eval_batches else {}
    save_final(model, tok, out, cfg, loaded)
    measured = state.measured_time_s or state.train_time_s
    tokens_per_s = (state.measured_tokens or state.tokens) / measured if measured else None
    matmul, layers, width = models.flop_dims(model)
    fpt = training_flops_per_token(matmul, trainable, layers, width, state.tokens / max(state.samples, 1),
                                   cfg.adapter.method == "full")
    peak, peak_source = hardware.peak_tflops(plan.device, plan.precision, hw, plan.threads,
                                             models.cache_dir() / "peak_flops.json")
    data_fraction = state.data_time_s / state.train_time_s if state.train_time_s else 0.0
    summary = {
        "model": cfg.model.name, "method": cfg.adapter.method, "quantization": cfg.adapter.quantization,
        "device": plan.device, "precision": plan.precision,
        "steps": state.step, "samples": state.samples, "tokens": state.tokens,
        "duration_s": round(wall, 3), "train_time_s": round(state.train_time_s, 3),
        "samples_per_s": state.samples / state.train_time_s if state.train_time_s else None,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt, "peak_tflops": peak, "peak_tflops_source": peak_source,
        "mfu": mfu(fpt, tokens_per_s, peak),
        "data_wait_fraction": round(data_fraction, 4),
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        **monitor.summary(),
        "train_loss": float(np.mean(state.losses)) if state.losses else None,
        "final_train_loss": state.losses[-1] if state.losses else None,
        "eval_loss_before": before["eval_loss"] if before else None,
        "eval_loss": after.get("eval_loss"), "perplexity": after.get("perplexity"),
        "trainable_parameters": trainable, "micro_batch_size": t.micro_batch_size, "grad_accum_steps": accum,
        "effective_batch_size": cfg.effective_batch_size, "max_length": cfg.data.max_length,
    }
    write_json(out / "summary.json", summary)
    if after:
        print(f"eval after training: loss {after['eval_loss']:.4f}, perplexity {after['perplexity']:.2f}")
    if data_fraction > 0.1:
        print(f"warning: input-bound: {100 * data_fraction:.0f}% of step time went to producing batches; "
              "lower --max-length padding waste or move tokenization off the hot path (see tunebench bench-data)")
    mfu_text = f"MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None else f"MFU n/a ({peak_source})"
    print(f"{state.step} steps in {wall:.1f}s, {tokens_per_s or 0:,.0f} real tokens/s, {mfu_text}; saved to {out}")
    return summary


def save_final(model, tokenizer, out: Path, cfg: RunConfig, loaded: models.Loaded) -> None:
    if cfg.adapter.method == "full":
        model.save_pretrained(out)
    else:
        model.peft_config["default"].base_model_name_or_path = loaded.path or cfg.model.name
        model.save_pretrained(out, save_embedding_layers=False)  # "auto" would look the base up on the hub
    tokenizer.save_pretrained(out)


def decide_layout(packing: str, data: Tokenized, train_idx: np.ndarray, micro_batch_size: int, seed: int,
                  capacity: int) -> tuple[str, str]:
    """How rows become batches: padded, length-grouped or packed, by the padding each leaves.

    The padding share is computed over the first epoch's batches exactly as collate would build
    them; padded positions cost as much compute as real ones.
    """
    lengths = data.lengths()
    plain = batching.epoch_order(train_idx, micro_batch_size, seed, 0)
    waste = {
        "padded": batching.padding_fraction(lengths, plain),
        "length-grouped": batching.padding_fraction(
            lengths, batching.epoch_order(train_idx, micro_batch_size, seed, 0, lengths=lengths)),
        "packed": batching.padding_fraction(lengths, plain, capacity),
    }
    numbers = ", ".join(f"{k} {100 * v:.0f}%" for k, v in waste.items())
    if packing == "on":
        return "packed", f"asked for (padding: {numbers})"
    options = ["padded", "length-grouped"] + (["packed"] if packing == "auto" else [])
    best = min(options, key=lambda k: (round(waste[k], 2), options.index(k)))  # ties: the simpler layout
    if waste["padded"] - waste[best] < 0.02:
        best = "padded"
    return best, f"least padding of {numbers}" if best != "padded" else f"padding: {numbers}"


def scaled_lr(lr: float, effective: int, rule: str, reference: int) -> tuple[float, str]:
    if rule == "none" or effective == reference:
        return lr, "not scaled (--lr-scaling none)" if rule == "none" else f"effective batch is the reference {reference}"
    factor = effective / reference if rule == "linear" else math.sqrt(effective / reference)
    return lr * factor, f"{rule} scaling: {lr:g} x {factor:.3g} for effective batch {effective} vs {reference}"


def enable_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need a grad path


def probe_step(model, data: Tokenized, train_idx: np.ndarray, pad_id: int, device: torch.device, autocast):
    """A step function for autotune: forward + backward on the longest rows, weights untouched."""
    lengths = data.lengths()
    longest = sorted(train_idx.tolist(), key=lambda i: -lengths[i])

    def step(size: int) -> tuple[float, float]:
        batch = batching.collate(data, longest[:size], pad_id)
        times = []
        reset_peak_memory(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for _ in range(3):
                t0 = time.perf_counter()
                b, n_loss, n_real = prepare(batch, device)
                (loss_sum(model, b, autocast, device) / max(n_loss, 1)).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        # The best repeat: a busy machine only ever slows a step down, so the minimum is the steadiest.
        return n_real / min(times[1:]), peak_memory_mb(device)

    step.model = model  # type: ignore[attr-defined]
    return step


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)


def free_after_oom(model) -> None:
    """Drop what a step that ran out of memory left behind, so the next try starts where it did."""
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_initialized():  # hand the failed step's cached blocks back to the driver
        torch.cuda.empty_cache()


ATTENTION_KERNELS = ("sdpa", "eager", kernels.NAME)  # run on every device and precision


def attention_candidates(device: torch.device, precision: str) -> tuple[str, ...]:
    """The kernels that can run here. flash-attn's joins on a CUDA GPU in 16-bit when installed; with
    packed rows, transformers hands it the restarting position_ids and it runs variable-length
    sequences without padding or a block mask."""
    names = ATTENTION_KERNELS
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            names += ("flash_attention_2",)
    return names


def pick_attention(model, requested: str, measure, key: str, too_big=lambda impl: None,
                   is_oom=is_oom, candidates: tuple[str, ...] = ATTENTION_KERNELS) -> tuple[str, Any, str]:
    """Set the attention kernel; `auto` times a probe step with each of `candidates` and keeps the
    fastest (cached).

    `too_big(impl)` says why a kernel would not fit in memory (None if it would): on a CPU an
    allocation past the RAM is not an exception but the kernel's OOM killer, so a kernel whose
    T x T weights would not fit is never tried, and a cached choice that no longer fits is measured again.
    """
    kernels.register()
    if requested != "auto":
        if requested not in candidates:
            raise TunebenchError(f"--attention {requested} cannot run here: it needs a CUDA GPU, bf16 or fp16, and "
                                 "the flash-attn package; use --attention auto")
        model.set_attn_implementation(requested)
        return ("attention", requested, "asked for")
    cache_file = models.cache_dir() / "autotune.json"
    cache_key = f"attention|{','.join(candidates)}|{key}"
    hit = autotune.cached_value(cache_file, cache_key)
    if hit is None or too_big(hit["value"]):
        skipped = {impl: why for impl in candidates if (why := too_big(impl))}
        speeds = {impl: 0.0 for impl in candidates if impl not in skipped}
        for _ in range(2):  # round-robin, best of two: a shared machine's drift hits every kernel alike
            for impl in list(speeds):
                model.set_attn_implementation(impl)
                try:
                    speeds[impl] = max(speeds[impl], measure())
                except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else re-raises
                    if not is_oom(e):
                        raise
                    free_after_oom(model)
                    skipped[impl] = "out of memory"
                    del speeds[impl]
        if not speeds:
            why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
            raise TunebenchError(f"no attention kernel fits in memory ({why}); lower --max-length or --batch-size")
        ranked = sorted(speeds, key=speeds.get, reverse=True)
        hit = {"value": ranked[0], "reason": "measured " + ", ".join(f"{speeds[k]:,.0f} ({k})" for k in ranked)
                                            + " tokens/s" + "".join(f"; {k} skipped: {v}" for k, v in skipped.items())}
        autotune.store_value(cache_file, cache_key, hit)
    model.set_attn_implementation(hit["value"])
    return ("attention", hit["value"], hit["reason"])


def attention_fit(model, rows: int, length: int, precision: str, device: torch.device):
    """`too_big` for pick_attention: a kernel whose kept attention weights would take over half the
    memory free now (the rest of the step needs room too) is not tried."""
    free = memory_free_mb(device)
    itemsize = DTYPES[precision].itemsize

    def too_big(impl: str) -> str | None:
        need = kernels.saved_weights_mb(model.config, rows, length, impl, itemsize)
        if need > free / 2:
            return f"its {rows} x {length} x {length} attention weights need ~{need:,.0f} MB of {free:,.0f} MB free"
        return None

    return too_big


def memory_free_mb(device: torch.device) -> float:
    """Memory a step may still allocate: free GPU memory, or 80% of available RAM (never into swap)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    import psutil

    return 0.8 * psutil.virtual_memory().available / 2**20


COMPILE_MEASURE_MIN_S = 180.0  # measuring costs a first compile and ~25 probe steps: ~1 min on 2 cores


def warm_up_compiled(model, measure) -> float:
    """Compile the blocks and run the first (compiling) probe; return its seconds beyond a steady probe's."""
    models.compile_blocks(model)
    t0 = time.perf_counter()
    measure()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    measure()
    return max(0.0, first - (time.perf_counter() - t0))


def eager_vs_compiled(measure, rounds: int = 2) -> tuple[float, float]:
    """Best (eager, compiled) tokens/s of the compiled model, measured in alternation so that a
    shared machine's drift slows both alike (separate timings once showed a gain that was not there)."""
    eager, compiled = [], []
    for _ in range(rounds):
        with torch.compiler.set_stance("force_eager"):
            eager.append(measure())
        compiled.append(measure())
    return max(eager), max(compiled)


def pick_compile(model, asked: hardware.Decision, quantized: bool, measure, run_tokens: float,
                 key: str, eager_speed: float | None = None) -> tuple[str, Any, str]:
    """Compile the decoder blocks when asked, or (`auto`) when measurement says it pays off in this run.

    The first long-enough run on a machine measures eager vs compiled tokens/s and the warm-up,
    and caches them; later runs compile only if the time saved over the run beats the warm-up
    with the compiler's disk cache warm. `eager_speed`, when the batch probe already timed this
    micro batch, spares a probe for the run-length estimate.
    """
    if asked.value != "auto":
        if asked.value:
            models.compile_blocks(model)
        return ("compile", asked.value, asked.reason)
    if quantized:
        return ("compile", False, "bitsandbytes layers break the compiled graph; --compile on to try")
    cache_file = models.cache_dir() / "autotune.json"
    cache_key = "compile|" + key
    hit = autotune.cached_value(cache_file, cache_key)
    if hit is None:
        run_s = run_tokens / (eager_speed or measure())
        if run_s < COMPILE_MEASURE_MIN_S:
            return ("compile", False, f"not measured: this run (~{run_s:.0f} s) is too short to win back a first "
                                      "compile; --compile on to force")
        cold = warm_up_compiled(model, measure)
        torch._dynamo.reset()  # again, from the compiler's disk cache: the warm-up later runs pay
        warm = warm_up_compiled(model, measure)
        eager, compiled = eager_vs_compiled(measure)
        hit = {"eager": eager, "compiled": compiled, "warmup_s": round(warm, 1)}
        autotune.store_value(cache_file, cache_key, hit)
        measured = (f"measured {compiled:,.0f} vs {eager:,.0f} tokens/s eager, alternating; warm-up {cold:.0f} s, "
                    f"{warm:.0f} s from cache")
        if compiled > 1.03 * eager:
            return ("compile", True, measured)
        models.uncompile_blocks(model)
        return ("compile", False, measured + ": no gain")
    eager, compiled, warm = hit["eager"], hit["compiled"], hit["warmup_s"]
    run_s = run_tokens / eager
    saved = run_s * (1 - eager / compiled)
    measured = f"measured {compiled:,.0f} vs {eager:,.0f} tokens/s eager"
    if compiled <= 1.03 * eager:
        return ("compile", False, measured + ": no gain")
    if saved <= warm:
        return ("compile", False, f"{measured}: saves ~{saved:.0f} s of this ~{run_s:.0f} s run, "
                                  f"less than its {warm:.0f} s warm-up")
    warm = warm_up_compiled(model, measure)
    autotune.store_value(cache_file, cache_key, dict(hit, warmup_s=round(warm, 1)))
    return ("compile", True, f"{measured}: saves ~{saved:.0f} s of this ~{run_s:.0f} s run for a {warm:.0f} s "
                             "warm-up")


def autotune_batch(cfg: RunConfig, step, n_train: int, device: torch.device, key: str):
    """Probe micro batches (or reuse the cached probe); return the config with the winner, the
    reasons, and the winner's measured tokens/s."""
    import psutil

    t = cfg.train
    if t.grad_accum_steps is not None:
        raise TunebenchError("--batch-size auto derives --grad-accum from --effective-batch-size; drop --grad-accum")
    key = f"batch|{key}|{t.effective_batch_size}|{t.gradient_checkpointing}|{min(n_train, t.effective_batch_size)}"
    cache_file = models.cache_dir() / "autotune.json"
    result = autotune.cached(cache_file, key)
    source = "cached probe"
    rows: list[tuple[str, Any, str]] = []
    if result is None:
        source = "probed now"
        sizes = [m for m in autotune.candidates(t.effective_batch_size) if m <= n_train] or [1]
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            baseline, budget = torch.cuda.memory_allocated(device) / 2**20, 0.92 * total / 2**20
        else:
            baseline = psutil.Process().memory_info().rss / 2**20
            budget = baseline + memory_free_mb(device)
        result = autotune.probe(step, sizes, budget, baseline, is_oom)
        if result.micro_batch_size == 0 and t.gradient_checkpointing == "auto":
            free_after_oom(step.model)
            enable_checkpointing(step.model)
            result = autotune.probe(step, sizes, budget, baseline, is_oom)
            rows.append(("gradient_checkpointing", True, "micro batch 1 did not fit without it"))
        if result.micro_batch_size == 0:
            raise TunebenchError(
                f"no micro batch fits in memory at --max-length {cfg.data.max_length}; lower --max-length, "
                "use --quantization 4bit, or --gradient-checkpointing on"
            )
        autotune.store(cache_file, key, result)
    print(f"batch-size probe ({source}):\n{autotune.format_table(result)}")
    rows.insert(0, ("micro_batch_size", result.micro_batch_size, f"{result.reason} ({source})"))
    speed = next(p.tokens_per_s for p in result.probes if p.micro_batch_size == result.micro_batch_size)
    return replace(cfg, **{"train.micro_batch_size": result.micro_batch_size}), rows, speed
