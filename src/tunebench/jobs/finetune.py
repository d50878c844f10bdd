"""`tunebench train`: LoRA, QLoRA or full fine-tuning of a causal LM. Reads top to bottom:
plan the hardware, load model and data, set up the method, decide the measured settings, train, save."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench import distributed, hardware, inference, methods, metrics, models, optim, preference, runner, runplan
from tunebench import tune
from tunebench import summary as summary_
from tunebench.config import RunConfig, dump_yaml
from tunebench.hardware import Decision
from tunebench.data import batching, mixture, pairs
from tunebench.data.tokenize import split
from tunebench.errors import TunebenchError
from tunebench.jsonfile import write_json
from tunebench.precision import DTYPES
from tunebench.metrics import training_flops_per_token
from tunebench.tune import compiler, layout
from tunebench.tune.probe import enable_checkpointing, memory_free_mb, probe_step

def build_model(cfg: RunConfig, loaded: models.Loaded, precision: str, device: torch.device):
    """Apply the method. Returns (model, autocast dtype, reasons). Frozen bases live in the compute dtype."""
    a = cfg.adapter
    compute = DTYPES[precision]
    rows: list[tuple[str, Any, str]] = []
    model = loaded.model
    if a.method == "full":
        rows.append(methods.apply_liger(model, cfg.train.liger, device.type))
        model.to(device)
        autocast = None if precision == "fp32" else compute
        rows.append(("weights", "fp32", "full fine-tuning keeps fp32 master weights" +
                     (f"; {precision} autocast for matmuls" if autocast else "")))
        return model, autocast, rows
    if a.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = methods.load_quantized(loaded, cfg.model.name, a.quantization, compute, cfg.model.allow_download)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        rows.append(("base weights", a.quantization, f"bitsandbytes {'nf4 + double quant' if a.quantization == '4bit' else 'LLM.int8'}, compute in {precision}"))
    else:
        model.to(dtype=compute)
        rows.append(("base weights", precision, "the run's precision" if precision == "fp32"
                     else "frozen: no fp32 master copy needed"))
    rows.append(methods.apply_liger(model, cfg.train.liger, device.type))  # on the base, before the adapters
    modules = None
    if a.method in methods.PROMPT_METHODS:
        rows.append(("virtual_tokens", a.num_virtual_tokens, f"{a.method} tuning: trained "
                     + ("key/value prefixes in every layer" if a.method == "prefix" else "input embeddings")
                     + (f", started from {a.prompt_init_text!r}" if a.method == "prompt" and a.prompt_init_text else "")))
    elif a.method == "ia3" and a.target_modules == "auto":
        rows.append(("target_modules", "auto", "PEFT's IA3 defaults for this architecture (attention keys/values "
                                               "and the feed-forward output)"))
    else:
        modules, why = methods.target_modules(model, a.target_modules)
        rows.append(("target_modules", ",".join(modules) if isinstance(modules, list) else modules, why))
    model = methods.add_adapter(model, a, modules, loaded.tokenizer)
    model.to(device)
    if a.method != "qlora" and precision != "fp32":
        if a.method in ("lora", "dora"):
            methods.compute_adapters_in(model)
        rows.append(("adapters", f"fp32 + {precision} autocast", "fp32 master weights, low-precision matmuls"
                     + (": no fp32 copies of activations per adapted layer" if a.method in ("lora", "dora") else "")))
        return model, compute, rows
    rows.append(("adapters", "fp32", "fp32 weights and compute"))
    return model, None, rows


def run(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    out = Path(t.output_dir)

    # -- every input checked before anything expensive: data, model, output directory, checkpoint
    prefer = t.objective != "sft"  # DPO or ORPO: the rows are preference pairs (data.pairs), a pair the unit
    unit = "pairs" if prefer else "rows"
    if prefer:
        pair_examples, parts = pairs.load(cfg.data), []
        print(f"data: {pair_examples.describe()}")
        check_rows(len(pair_examples), cfg, 0, "")
    else:
        parts = mixture.parts(cfg.data)  # one dataset, or each of data.sources with its weight
        for part in parts:
            if part.examples.empty_rows:
                print(f"data{'' if len(parts) == 1 else ' ' + part.name}: {part.examples.describe_dropped()}")
        check_rows(sum(len(p.examples.messages) for p in parts), cfg,
                   sum(len(p.examples.empty_rows) for p in parts), "empty")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    inference.check_length(cfg.model.name, cfg.data.max_length, cfg.model.allow_download)

    # -- the run opened: hardware plan, process group, output directory and resume point, batch, seed
    identity = {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "seed": t.seed,
                "data": cfg.data.path if not cfg.data.sources else [list(s) for s in cfg.data.sources]}
    if prefer:
        identity["objective"] = {"objective": t.objective, "beta": t.beta, "orpo_lambda": t.orpo_lambda}
    ask = cfg.batch_ask()
    opened = runner.open_run(out, device=t.device, precision=t.precision, compile=t.compile, threads=t.threads,
                             backend=t.backend, resume=t.resume, overwrite=t.overwrite, identity=identity, ask=ask,
                             seed=t.seed)
    hw, hw_plan, world, device = opened.hw, opened.hw_plan, opened.world, opened.device
    effective, resumed = opened.effective, opened.resumed

    # -- model and data (each machine's first rank fills the caches, its others read them)
    with distributed.local_rank0_first(world):
        loaded = models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download)
        tok = loaded.tokenizer
        if prefer:
            data, messages = pairs.tokenize(pair_examples, tok, cfg.data), []
            spans = [np.arange(len(data))]
        else:
            data, spans, messages = mixture.tokenize(parts, tok, models.cache_dir())
    check_rows(len(data), cfg, data.dropped, "whose prompt alone fills --max-length" if prefer
               else "left without a response by truncation at --max-length")
    train_parts, eval_parts = mixture.splits(spans, cfg.data, t.seed)
    train_idx = train_parts[0] if len(parts) <= 1 else mixture.mixture(train_parts, [p.weight for p in parts], t.seed)
    eval_idx = np.concatenate(eval_parts)
    if len(parts) > 1:
        print("data: " + ", ".join(f"{p.name} {p.weight:.0%} of the training rows ({len(tr)} rows, {len(ev)} held out)"
                                   for p, tr, ev in zip(parts, train_parts, eval_parts)))
    if t.eval_generate and (len(eval_idx) == 0 or data.fmt == "text"):
        raise TunebenchError("--eval-generate answers held-out prompt/response rows, and this run holds none out "
                             f"({'plain text' if data.fmt == 'text' else 'eval_fraction 0'}); set --eval-fraction "
                             "above 0 on instruction, alpaca or chat data, or drop --eval-generate")
    model, autocast, method_rows = build_model(cfg, loaded, hw_plan.precision, device)
    model.config.use_cache = False
    loss_module = None
    if prefer:
        loss_module, row = preference_loss(model, cfg, autocast)
        method_rows.append(row)
    trainable, total = metrics.count_parameters(model)
    if trainable == 0:
        raise TunebenchError("nothing to train: no parameter requires a gradient; check --method and --target-modules")

    # -- measured decisions: attention kernel, micro batch (the effective batch stays fixed), compile, layout.
    # Rank 0 measures; the other ranks take its answers (ranks never disagree, never race on the cache).
    if t.gradient_checkpointing == "on":
        enable_checkpointing(model)
    lengths = data.lengths()  # of each unit: an example, or a pair's longer row
    tokens_per_row = float(np.mean((data.tokens() if prefer else lengths)[train_idx]))
    steps = runplan.total_steps(len(train_idx), effective, t.epochs, t.max_steps, t.max_tokens, tokens_per_row)
    parallel = hardware.pick_parallel(t.parallel, cfg.adapter.method, trainable, world.size,
                                      memory_free_mb(device, world.local_size))
    if t.eval_generate and parallel == "fsdp":
        raise TunebenchError("--eval-generate needs the whole model on one rank, and FSDP shards it; run "
                             "`tunebench eval --adapter OUT --generate N` after training instead")

    collate_unit = pairs.collate if prefer else batching.collate  # a unit is a row, or a pair's two rows
    collate = lambda rows_: collate_unit(data, rows_, tok.pad_token_id)  # noqa: E731

    def measure() -> runplan.Measured:
        longest = sorted(train_idx.tolist(), key=lambda i: -lengths[i])
        step = probe_step(model, lambda size: collate(longest[:size]), device, autocast, loss_module)
        a = cfg.adapter
        # A preference step is a pair's two rows plus DPO's reference pass: measured apart from SFT's rows.
        shape = tune.Shape(cfg.model.name, a.method if not prefer else f"{a.method}+{t.objective}", a.quantization,
                           a.num_virtual_tokens if a.method in methods.PROMPT_METHODS else a.r, a.target_modules,
                           cfg.data.max_length, tune.where(hw, hw_plan, device), hw_plan.precision,
                           hw.versions.get("torch", ""), t.attention, t.liger, t.gradient_checkpointing)
        return runplan.measure(
            model, step, shape, world_size=world.size, device=device, precision=hw_plan.precision,
            attention_asked=t.attention, attention_rows=min(ask.micro or t.micro_batch_size, len(train_idx)),
            # Packed rows fill max_length, so a kernel must fit that, not just the longest example.
            widest=cfg.data.max_length if cfg.data.packing != "off" else int(lengths[train_idx].max()),
            effective=effective, resumed=resumed, micro_asked=ask.micro, asked_reason="asked for",
            n_train=len(train_idx), max_length=cfg.data.max_length, checkpointing=t.gradient_checkpointing,
            compile_asked=runner.compile_decision(hw_plan, parallel.value), compile_mode=t.compile_mode, quantized=a.method == "qlora",
            run_tokens=steps * effective * tokens_per_row, local_ranks=world.local_size)

    measured, measure_s = runner.measured_by_rank0(world, model, measure)
    micro, accum = measured.micro_batch_size, measured.grad_accum_steps
    prompt_method = cfg.adapter.method in methods.PROMPT_METHODS
    packing = "off" if prompt_method or prefer else cfg.data.packing  # a pair's two rows stay side by side
    batch_layout, layout_reason = layout.decide(packing, lengths, train_idx, micro * world.size, t.seed,
                                                cfg.data.max_length, effective)
    if prompt_method and cfg.data.packing == "auto":
        layout_reason += f"; not packed: {cfg.adapter.method} tuning drops the position ids that separate packed rows"
    lr, lr_reason = scaled_lr(t.lr, effective, t.lr_scaling, t.lr_reference_batch)
    plan = runplan.make(hw_plan, world, parallel, measured, effective, accum, steps, [
        *[d for d in hw_plan.decisions if d.setting != "compile"], Decision("world", world.size, world.describe()),
        parallel, *method_rows, *[d for d in measured.decisions if d.setting != "compile"],
        Decision("batch layout", batch_layout, layout_reason), *[d for d in measured.decisions if d.setting == "compile"],
        optim.optimizer_row(device, t.weight_decay), runplan.batch_row(effective, micro, accum, world.size),
        Decision("lr", f"{lr:g}", lr_reason), runplan.logging_row(t.logging_steps, device.type),
        Decision("total_steps", steps, "--max-steps" if t.max_steps else
                 f"--max-tokens {t.max_tokens:,} at {tokens_per_row:.1f} real tokens a row" if t.max_tokens
                 else f"{t.epochs:g} epoch(s) of {len(train_idx)} {unit}, {effective} a step")])
    if world.main:
        print(f"model: {loaded.source}")
        print(f"data: {' + '.join(p.config.path for p in parts) or cfg.data.path} ({data.fmt}), {len(train_idx)} "
              f"train / {len(eval_idx)} eval {unit}"
              + (f"; {data.dropped} of {len(data) + data.dropped} {unit} dropped: "
                 f"{'the prompt alone fills --max-length' if prefer else 'no response left after truncation'}"
                 if data.dropped else ""))
        print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")
        summary_.print_plan(plan.decisions)

    # -- batches: each epoch's optimizer steps (seed, epoch, effective batch), split into this rank's micro-batches
    group_lengths = lengths if batch_layout == "length-grouped" else None
    packed = lambda rows_: batching.collate_packed(data, rows_, tok.pad_token_id, cfg.data.max_length)  # noqa: E731
    next_micro_batch = runner.micro_batches(
        lambda epoch: batching.epoch_steps(train_idx, effective, t.seed, epoch, lengths=group_lengths),
        packed if batch_layout == "packed" else collate, world, micro, accum)
    names = [p.name for p in parts] or ["pairs"]
    eval_sets = [(name, batching.eval_batches(data, e, micro * 2, tok.pad_token_id, collate_unit))
                 for name, e in zip(names, eval_parts) if len(e)]

    def records() -> None:
        dump_yaml(cfg, out / "config.yaml")  # the configuration as asked (auto stays auto); plan.json: what it became
        write_json(out / "plan.json", {"hardware": hw.to_dict(), "decisions": plan.to_json(),
                                       "trainable_parameters": trainable, "total_parameters": total,
                                       "model_source": loaded.source})

    # -- train (optimizer, schedule, records, loop, evaluation), then the outputs on rank 0
    outcome, weights = runner.train_run(
        out, opened, plan, model, autocast, loss=loss_module, seed=t.seed, records=records,
        optimization=runner.Optimization(lr, t.weight_decay, t.schedule, int(t.warmup_ratio * steps), t.max_grad_norm),
        outputs=runner.Outputs(int(plan.value("logging_steps")), t.eval_steps, t.save_steps, t.save_total_limit,
                               t.progress, t.report_to, t.monitor),
        next_micro_batch=next_micro_batch, eval_sets=eval_sets, identity=identity,
        pin_memory=bool(hw_plan.value("pin_memory")))
    if not world.main:
        return {}
    save_final(model, tok, out, cfg, loaded, weights)
    matmul, layers, width = metrics.flop_dims(model)
    state = outcome.state
    # Attention over each example's own length (token-weighted), not the packed row's width.
    seq = state.token_sq / max(state.tokens, 1)
    fpt = training_flops_per_token(matmul, trainable, layers, width, seq, cfg.adapter.method == "full")
    if t.objective == "dpo":  # the reference's forward pass over every token: 2N for the matmuls, a third of attention
        fpt += 2 * matmul + 4 * layers * width * seq
    summary = {
        "model": cfg.model.name, "method": cfg.adapter.method, "quantization": cfg.adapter.quantization,
        **summary_.figures(outcome, fpt, hw_plan, hw, world), "parallel": plan.parallel,
        "trainable_parameters": trainable, "micro_batch_size": micro, "grad_accum_steps": accum,
        "effective_batch_size": effective, "max_length": cfg.data.max_length, "measure_s": round(measure_s, 3),
    }
    summary.update({k: v for k, v in outcome.after.items()
                    if k.startswith(("eval_loss/", "eval_rewards/", "eval_pairs"))})
    if prefer:
        summary.update({"objective": t.objective, **({"beta": t.beta} if t.objective == "dpo" else
                                                     {"orpo_lambda": t.orpo_lambda}),
                        "pairs_skipped": pair_examples.skipped, "pairs_dropped": data.dropped})
    if t.eval_generate:  # preference runs answer their held-out pairs' prompts, scored against the chosen reply
        groups = [("pairs", [pair_examples.answered(data.source(i)) for i in eval_idx[:t.eval_generate]])] if prefer \
            else [(p.name, [messages[data.rows[i]] for i in e[:t.eval_generate]]) for p, e in zip(parts, eval_parts)]
        summary.update(task_scores(model, tok, [g for g in groups if g[1]], cfg, out, device, autocast))
    write_json(out / "summary.json", summary)
    summary_.report(summary, out)
    return summary


def preference_loss(model, cfg: RunConfig, autocast) -> tuple[preference.PreferenceLoss, Decision]:
    """The DPO or ORPO objective over `model`, and its settings row. DPO's reference is the model with its
    adapter off, or (full fine-tuning) a frozen copy made here, before any step, so the probe counts it."""
    t = cfg.train
    dropped = preference.disable_dropout(model)
    dropout = f"; base dropout off in {dropped} module(s) (TRL's default)" if dropped else ""
    if t.objective == "orpo":
        return (preference.PreferenceLoss(model, "orpo", t.orpo_lambda, autocast),
                Decision("objective", "orpo", f"lambda {t.orpo_lambda:g}; no reference model{dropout}"))
    full = cfg.adapter.method == "full"
    reference = preference.reference_copy(model) if full else None
    return (preference.PreferenceLoss(model, "dpo", t.beta, autocast, reference),
            Decision("objective", "dpo", f"beta {t.beta:g}; reference: " + (
                "a frozen copy of the starting weights" if full else "the base with the adapter off (no copy)")
                + dropout))


def task_scores(model, tok, groups: list[tuple[str, list]], cfg: RunConfig, out: Path, device: torch.device,
                autocast: torch.dtype | None) -> dict[str, Any]:
    """The trained model's answers to each dataset's held-out rows, scored (ROUGE-L, chrF, exact match, EOS
    rate) in the run's own prompt format: overall, and per dataset (rougeL/<name>, ...) when there are
    several. The answers go to eval_answers.jsonl. The model generates as it trained (inference.Placed): its
    weights as they are, under the run's autocast."""
    from tunebench import quality

    compiler.uncompile_blocks(model)
    model.config.use_cache = True
    rows = [r for _, group in groups for r in group]
    answers, seconds = quality.generate_answers(inference.Placed(model, tok, device, autocast), rows, cfg.data.template,
                                                cfg.train.eval_max_new_tokens, seed=cfg.train.seed)
    scores = quality.score(answers, seconds)
    if len(groups) > 1:
        start = 0
        for name, group in groups:
            part = quality.score(answers[start:start + len(group)], seconds * len(group) / len(rows))
            scores |= {f"{k}/{name}": v for k, v in part.items()
                       if k in quality.SCORES and v is not None}
            start += len(group)
    quality.write_answers(out / "eval_answers.jsonl", answers, scores)
    shown = ", ".join(f"{k} {v}" for k, v in scores.items() if v is not None)
    print(f"answers to {len(rows)} held-out rows: {shown} (each in {out / 'eval_answers.jsonl'})")
    return scores


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


def save_final(model, tokenizer, out: Path, cfg: RunConfig, loaded: models.Loaded, weights: dict | None = None) -> None:
    """The model (or adapter) and tokenizer; `weights`, a sharded model's gathered state dict."""
    if cfg.adapter.method == "full":
        model.save_pretrained(out, state_dict=weights)
    else:
        model.peft_config["default"].base_model_name_or_path = loaded.path or cfg.model.name
        model.save_pretrained(out, save_embedding_layers=False)  # "auto" would look the base up on the hub
    tokenizer.save_pretrained(out)


def scaled_lr(lr: float, effective: int, rule: str, reference: int) -> tuple[float, str]:
    if rule == "none" or effective == reference:
        return lr, "not scaled (--lr-scaling none)" if rule == "none" else f"effective batch is the reference {reference}"
    factor = effective / reference if rule == "linear" else math.sqrt(effective / reference)
    return lr * factor, f"{rule} scaling: {lr:g} x {factor:.3g} for effective batch {effective} vs {reference}"
