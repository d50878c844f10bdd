"""A base model with its fine-tuning method applied, as the fine-tuning recipes (SFT, DPO/ORPO/KTO, GRPO) build,
measure, split, save and summarize it: the parts jobs/finetune.py and jobs/grpo.py share, below both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core.decision import Decision
from tunebench.core.durable import atomic_files, landing
from tunebench.core.errors import TunebenchError
from tunebench.core.precision import DTYPES
from tunebench.data import batching, judged, mixture, pairs
from tunebench.data.tokenize import split
from tunebench.machine import hardware, metrics
from tunebench.machine.metrics import training_flops_per_token
from tunebench.model import inference, methods, models
from tunebench.settings.finetune import RunConfig
from tunebench.training import preference, runner
from tunebench.training import summary as summary_
from tunebench.training.autotune import compiler, layout, memory
from tunebench.training.autotune.probe import enable_checkpointing, memory_free_mb


def identity(cfg: RunConfig, **extra) -> dict[str, Any]:
    """What a resume of this run must match: the model, the adapter's settings, the seed, the data."""
    d = cfg.data
    return {"model": cfg.model.name, "adapter": cfg.to_dict()["adapter"], "seed": cfg.schedule.seed,
            "data": d.path if not d.sources else [list(s) for s in d.sources], **extra}


def records(loaded: models.Loaded, trainable: int, total: int) -> dict[str, Any]:
    """plan.json's fields on what trains."""
    return {"trainable_parameters": trainable, "total_parameters": total, "model_source": loaded.source}


def load_dtype(cfg: RunConfig, opened: runner.Opened) -> torch.dtype:
    """The dtype the base is loaded in: a full fine-tune's fp32 master weights; QLoRA's fp32, which it quantizes
    from (a preset is saved from these weights first: quantized from bf16-rounded ones, its losses moved 2e-4
    from HF's); else the frozen base's compute dtype, where build_model keeps it."""
    return torch.float32 if cfg.adapter.method in ("full", "qlora") else DTYPES[opened.hw_plan.precision]


def load(cfg: RunConfig, opened: runner.Opened) -> models.Loaded:
    """The base model and its tokenizer, found or converted once and loaded in load_dtype."""
    return models.resolve(cfg.model.name, cfg.model.tokenizer, cfg.model.allow_download, load_dtype(cfg, opened))


def check_memory(cfg: RunConfig, opened: runner.Opened) -> None:
    """Refuse, before a weight loads, a model whose smallest step (micro batch 1, checkpointing on) cannot fit the
    memory free here, naming the method that would (the memory plan, training/autotune/memory.py)."""
    config = models.config_of(cfg.model.name, cfg.model.allow_download)
    if config is None or cfg.adapter.method in methods.PROMPT_METHODS + ("ia3",):
        return
    shape = memory.on_meta(config)
    a = cfg.adapter
    _, refused = memory.check_fits(shape, f"--model {cfg.model.name} with --method {a.method}", a.method,
                                   DTYPES[opened.hw_plan.precision].itemsize,
                                   a.r, a.target_modules, cfg.data.max_length,
                                   memory_free_mb(opened.device, opened.world.local_size), opened.device.type,
                                   opened.runtime_mb)
    if refused:
        raise TunebenchError(refused)


def build_model(cfg: RunConfig, loaded: models.Loaded, precision: str, device: torch.device):
    """Apply the method. Returns (model, reasons). Frozen bases live in the compute dtype. The autocast every
    method trains, probes, evaluates and answers under is the run's precision's (core.precision.autocast_dtype,
    read as runner.Opened.autocast): one source, not one per method."""
    a = cfg.adapter
    compute = DTYPES[precision]
    rows: list[tuple[str, Any, str]] = []
    model = loaded.model
    if a.method == "full":
        rows.append(methods.apply_liger(model, cfg.hardware.liger, device.type))
        model.to(device)
        rows.append(("weights", "fp32", "full fine-tuning keeps fp32 master weights" +
                     (f"; {precision} autocast for matmuls" if precision != "fp32" else "")))
        return model, rows
    if a.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = methods.load_quantized(loaded, cfg.model.name, a.quantization, compute, cfg.model.allow_download)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        rows.append(("base weights", a.quantization, f"bitsandbytes {'nf4 + double quant' if a.quantization == '4bit' else 'LLM.int8'}, compute in {precision}"))
    else:
        model.to(dtype=compute)
        rows.append(("base weights", precision, "the run's precision" if precision == "fp32"
                     else "frozen: no fp32 master copy needed"))
    rows.append(methods.apply_liger(model, cfg.hardware.liger, device.type))  # on the base, before the adapters
    modules = None
    if a.method in methods.PROMPT_METHODS:
        rows.append(("virtual_tokens", a.num_virtual_tokens, f"{a.method} tuning: trained "
                     + ("key/value prefixes in every layer" if a.method == "prefix" else "input embeddings")
                     + (f", started from {a.prompt_init_text!r}" if a.method == "prompt" and a.prompt_init_text else "")))
    elif a.method == "ia3" and a.target_modules == "auto":
        targets, _, why = methods.ia3_modules(model, None)
        rows.append(("target_modules", ",".join(targets), why))
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
    elif a.method == "qlora" and precision != "fp32":
        rows.append(("adapters", f"fp32 + {precision} autocast", f"fp32 master weights; the 4-bit base computes in "
                     f"{precision}, and the adapters' matmuls run under the same {precision} autocast in the probe, "
                     "every step and the answers (as HF Trainer's bf16=True trains QLoRA)"))
    else:
        rows.append(("adapters", "fp32", "fp32 weights and compute"))
    return model, rows




def trainable_model(cfg: RunConfig, loaded: models.Loaded, opened: runner.Opened, prefer: bool):
    """(model with its method applied, the preference loss or None, its settings rows, (trainable, total)
    parameters); refused when nothing would train."""
    model, rows = build_model(cfg, loaded, opened.hw_plan.precision, opened.device)
    autocast = opened.autocast
    model.config.use_cache = False
    if cfg.hardware.gradient_checkpointing == "on":
        enable_checkpointing(model)
    loss_module = None
    if prefer:
        loss_module, row = preference_loss(model, cfg, autocast)
        rows.append(row)
    trainable, total = metrics.count_parameters(model)
    if trainable == 0:
        raise TunebenchError("nothing to train: no parameter requires a gradient; check --method and --target-modules")
    return model, loss_module, rows, (trainable, total)


def pick_parallel(cfg: RunConfig, opened: runner.Opened, trainable: int) -> Decision:
    """DDP or FSDP2 under several ranks (hardware.pick_parallel), and what FSDP cannot do here."""
    world = opened.world
    parallel = hardware.pick_parallel(cfg.distributed.parallel, cfg.adapter.method, trainable, world.size,
                                      memory_free_mb(opened.device, world.local_size))
    if cfg.evaluation.eval_generate and parallel == "fsdp":
        raise TunebenchError("--eval-generate needs the whole model on one rank, and FSDP shards it; run "
                             "`tunebench eval --adapter OUT --generate N` after training instead")
    return parallel


def kto_micro_batch(opened: runner.Opened, kto: bool) -> dict[str, Any]:
    """KTO's micro batch is part of its math (its KL reference point is estimated over each one, as over TRL's
    per-device batch), so the probe never picks it: the whole effective batch on each rank, unless asked."""
    if not kto:
        return {}
    why = "KTO estimates its KL reference point over each micro batch (TRL's per-device batch), so it is not measured"
    if opened.ask.micro:
        return {"asked_reason": f"asked for; {why}"}
    return {"micro": opened.effective // opened.world.size,
            "asked_reason": f"the effective batch: {why}; --batch-size N estimates it over N rows instead"}


def measured_as(cfg: RunConfig, prefer: bool) -> tuple:
    """What is trained, as the measurement cache keys it: a preference step is a pair's two rows plus DPO's
    reference pass, measured apart from SFT's rows."""
    a = cfg.adapter
    return (cfg.model.name, a.method if not prefer else f"{a.method}+{a.objective}", a.quantization,
            a.num_virtual_tokens if a.method in methods.PROMPT_METHODS else a.r, a.target_modules)


DROPPED = {True: "the prompt alone fills --max-length", False: "no response left after truncation"}


def header(cfg: RunConfig, loaded: models.Loaded, parts, data, n_train: int, eval_parts, unit: str, trainable: int,
           total: int) -> str:
    """The lines above the settings table: the model, the data and its split, what trains."""
    prefer = cfg.adapter.objective != "sft"
    dropped = (f"; {data.dropped} of {len(data) + data.dropped} {unit} dropped: {DROPPED[prefer]}" if data.dropped
               else "")
    return (f"model: {loaded.source}\ndata: {' + '.join(p.config.path for p in parts) or cfg.data.path} ({data.fmt}), "
            f"{n_train} train / {sum(map(len, eval_parts))} eval {unit}{dropped}\n"
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")


def template_rows(tok) -> list[Decision]:
    """The chat template's row where the run put tunebench's tool template on the tokenizer (data.toolcalls)."""
    from tunebench.data import toolcalls

    if getattr(tok, "chat_template", None) != toolcalls.TEMPLATE:
        return []
    return [Decision("chat_template", toolcalls.NAME, "the data carries tool calls or reasoning and the model's own "
                     "template does not render them: Hermes <tool_call> JSON (Qwen2.5's form), saved with the run")]


def held_out_answers(cfg: RunConfig, opened: runner.Opened, model, tok, data, examples, messages, parts,
                     eval_parts) -> dict[str, Any]:
    """With --eval-generate N, the scores of the trained model's answers to N held-out rows of each dataset; a
    preference run answers its held-out prompts, scored against the chosen reply (KTO: the desirable
    completions only; an undesirable one is no answer to match)."""
    n = cfg.evaluation.eval_generate
    if not n:
        return {}
    if cfg.adapter.objective != "sft":
        kto = cfg.adapter.objective == "kto"
        held = [i for i in np.concatenate(eval_parts) if not kto or data.labels[i]][:n]
        groups = [("pairs", [examples.answered(data.source(i)) for i in held])]
    else:
        groups = [(p.name, [messages[data.rows[i]] for i in e[:n]]) for p, e in zip(parts, eval_parts)]
    return task_scores(model, tok, [g for g in groups if g[1]], cfg, opened.out, opened.device, opened.autocast)


def check_inputs(cfg: RunConfig, prefer: bool):
    """(preference pairs or None, the datasets) read and checked before anything expensive: enough rows for a
    step, a model that can be found, a max length it takes, a scored eval that has rows to answer."""
    if prefer:
        examples, parts = (judged if cfg.adapter.objective == "kto" else pairs).load(cfg.data), []
        print(f"data: {examples.describe()}")
        check_rows(len(examples), cfg, 0, "")
    else:
        examples, parts = None, mixture.parts(cfg.data)  # one dataset, or each of data.sources with its weight
        for part in parts:
            if part.examples.empty_rows:
                print(f"data{'' if len(parts) == 1 else ' ' + part.name}: {part.examples.describe_dropped()}")
        check_rows(sum(len(p.examples.messages) for p in parts), cfg,
                   sum(len(p.examples.empty_rows) for p in parts), "empty")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    if cfg.data.max_length is not None:  # auto is settled within the model's positions (settle_length)
        inference.check_length(cfg.model.name, cfg.data.max_length, cfg.model.allow_download)
    return examples, parts


LENGTH_QUANTILE = 99  # auto keeps this percent of the rows whole
LENGTH_STEP = 64  # and rounds up to a multiple of this (the loss rows are padded to 64 too)
LENGTH_SAMPLE = 4096  # rows auto tokenizes to find it: a seeded sample of a bigger dataset


def settle_length(cfg: RunConfig, lengths_of) -> tuple[RunConfig, Decision]:
    """`cfg` with data.max_length a number, and its settings row: as asked, or for auto (None) the length that
    keeps the rows whole: the 99th percentile of their tokens as training renders them (`lengths_of(tokenizer,
    sample)`, the tokenizer alone, no weights), rounded up to 64, capped at the positions the model learned.
    Rows longer than it are cut, and counted where they are today."""
    import dataclasses

    d = cfg.data
    if d.max_length is not None:
        return cfg, Decision("max_length", d.max_length, "asked for")
    limit, kind = inference.positions(cfg.model.name, cfg.model.allow_download)
    tok = models.load_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else \
        models.tokenizer_for(cfg.model.name, cfg.model.allow_download)  # the run's own, as adapted.load gives it
    rng = np.random.default_rng(cfg.schedule.seed)
    lengths = np.asarray(lengths_of(tok, lambda n: np.sort(rng.permutation(n)[:LENGTH_SAMPLE])))
    if not len(lengths):
        raise TunebenchError(f"--max-length auto: no row of '{d.path}' could be measured; pass --max-length N")
    top = int(np.ceil(np.percentile(lengths, LENGTH_QUANTILE)))
    length = -(-top // LENGTH_STEP) * LENGTH_STEP
    capped = limit is not None and length > limit
    length = min(length, limit) if capped else length
    over = int((lengths > length).sum())
    sample = f" of a sample of {len(lengths):,}" if len(lengths) == LENGTH_SAMPLE else ""
    why = (f"auto: {LENGTH_QUANTILE}% of the rows{sample} have {top:,} tokens or fewer (the longest {int(lengths.max()):,}), "
           f"rounded up to a multiple of {LENGTH_STEP}" + (f", capped at the {limit:,} positions this model learned "
                                                          f"({kind})" if capped else "")
           + f"; {over} of {len(lengths):,} rows are longer and are cut; --max-length N sets it")
    return dataclasses.replace(cfg, data=dataclasses.replace(d, max_length=length)), Decision("max_length", length, why)


def row_lengths(cfg: RunConfig, prefer: bool, kto: bool, examples, parts):
    """`settle_length`'s measure for the fine-tuning recipes: tokens per row (a pair's longer row, a judged
    completion with its prompt) as training renders them, uncut."""
    import dataclasses

    from tunebench.data.tokenize import tokenize_messages, use_template

    def lengths(tok, sample) -> list[int]:
        if prefer:
            return (judged if kto else pairs).tokenize(examples, tok, dataclasses.replace(
                cfg.data, max_length=10**9)).lengths().tolist()
        out: list[int] = []
        for part in parts:
            messages = part.examples.messages
            rows = [messages[i] for i in sample(len(messages))]
            whole = dataclasses.replace(part.config, max_length=10**9)
            use_template(rows, tok, whole)
            out += tokenize_messages(rows, tok, whole, part.examples.fmt).lengths().tolist()
        return out

    return lengths


def split_rows(cfg: RunConfig, data, spans, parts, prefer: bool):
    """(the training rows in the mixture's proportions, each dataset's training and held-out rows), checked:
    enough rows left after tokenizing, and held-out rows with replies when the run scores its answers."""
    check_rows(len(data), cfg, data.dropped, "whose prompt alone fills --max-length" if prefer
               else "left without a response by truncation at --max-length")
    seed = cfg.schedule.seed
    train_parts, eval_parts = mixture.splits(spans, cfg.data, seed)
    train_idx = train_parts[0] if len(parts) <= 1 else mixture.mixture(train_parts, [p.weight for p in parts], seed)
    if len(parts) > 1:
        print("data: " + ", ".join(f"{p.name} {p.weight:.0%} of the training rows ({len(tr)} rows, {len(ev)} held out)"
                                   for p, tr, ev in zip(parts, train_parts, eval_parts)))
    if cfg.evaluation.eval_generate and (sum(map(len, eval_parts)) == 0 or data.fmt == "text"):
        raise TunebenchError("--eval-generate answers held-out prompt/response rows, and this run holds none out "
                             f"({'plain text' if data.fmt == 'text' else 'eval_fraction 0'}); set --eval-fraction "
                             "above 0 on instruction, alpaca or chat data, or drop --eval-generate")
    return train_idx, train_parts, eval_parts


def batcher(cfg: RunConfig, opened: runner.Opened, prefer: bool, data, train_idx, collate_unit, pad_id: int):
    """micro batch -> (each epoch's steps, the collate of a micro batch, the batch layout's row): the layout
    decided for the micro batch the runner measured."""
    lengths = data.lengths()

    def batches(micro: int):
        layout, row = decide_layout(cfg, prefer, lengths, train_idx, micro * opened.world.size, opened.effective)
        steps = lambda epoch: batching.epoch_steps(  # noqa: E731
            train_idx, opened.effective, cfg.schedule.seed, epoch, lengths=lengths if layout == "length-grouped" else None)
        if layout == "packed":
            return steps, lambda rows: batching.collate_packed(data, rows, pad_id, cfg.data.max_length), [row]
        return steps, lambda rows: collate_unit(data, rows, pad_id), [row]
    return batches


def decide_layout(cfg: RunConfig, prefer: bool, lengths, train_idx, rows_per_step: int,
                  effective: int) -> tuple[str, Decision]:
    """How rows are laid out in a micro batch (packed, length-grouped or as they come), and its row."""
    prompt_method = cfg.adapter.method in methods.PROMPT_METHODS
    packing = "off" if prompt_method or prefer else cfg.data.packing  # a pair's two rows stay side by side
    batch_layout, reason = layout.decide(packing, lengths, train_idx, rows_per_step, cfg.schedule.seed,
                                         cfg.data.max_length, effective)
    if prompt_method and cfg.data.packing == "auto":
        reason += f"; not packed: {cfg.adapter.method} tuning drops the position ids that separate packed rows"
    return batch_layout, Decision("batch layout", batch_layout, reason)


def summarize(cfg: RunConfig, opened: runner.Opened, plan, model, outcome: runner.Outcome, trainable: int,
              measure_s: float) -> dict[str, Any]:
    """The run's figures: speed, MFU (FLOPs from the model's shape), memory, losses, the batch it trained with."""
    a = cfg.adapter
    matmul, layers, width = metrics.flop_dims(model)
    state = outcome.state
    seq = state.token_sq / max(state.tokens, 1)  # attention over each example's own length, not the packed row's
    fpt = training_flops_per_token(matmul, trainable, layers, width, seq, a.method == "full")
    # DPO's reference pass; KTO's, and both over its KL rows; GRPO's when beta puts a KL term in its loss
    forwards = {"dpo": 1, "kto": 3, "grpo": 1 if a.beta else 0}.get(a.objective, 0)
    fpt += forwards * (2 * matmul + 4 * layers * width * seq)  # each 2N for the matmuls, a third of attention
    summary = {
        "model": cfg.model.name, "method": a.method, "quantization": a.quantization,
        **summary_.figures(outcome, fpt, opened.hw_plan, opened.hw, opened.world), "parallel": plan.parallel,
        "trainable_parameters": trainable, "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": plan.grad_accum_steps, "effective_batch_size": opened.effective,
        "max_length": cfg.data.max_length, "measure_s": round(measure_s, 3),
    }
    summary.update({k: v for k, v in outcome.after.items()
                    if k.startswith(("eval_loss/", "eval_rewards/", "eval_pairs", "eval_kl", "eval_examples"))})
    if a.objective != "sft":
        summary.update({"objective": a.objective, **({"orpo_lambda": a.orpo_lambda} if a.objective == "orpo" else
                                                     {"beta": a.beta})})
    return summary


def preference_loss(model, cfg: RunConfig, autocast) -> tuple[preference.PreferenceLoss, Decision]:
    """The DPO, ORPO or KTO objective over `model`, and its settings row (see reference_for)."""
    t = cfg.adapter
    dropped = preference.disable_dropout(model)
    dropout = f"; base dropout off in {dropped} module(s) (TRL's default)" if dropped else ""
    if t.objective == "orpo":
        return (preference.PreferenceLoss(model, "orpo", t.orpo_lambda, autocast),
                Decision("objective", "orpo", f"lambda {t.orpo_lambda:g}; no reference model{dropout}"))
    reference, words = reference_for(model, t.method == "full")
    if t.objective == "kto":
        weights = (t.desirable_weight, t.undesirable_weight)
        return (preference.PreferenceLoss(model, "kto", t.beta, autocast, reference, weights),
                Decision("objective", "kto", f"beta {t.beta:g}, desirable/undesirable weights {weights[0]:g}/"
                         f"{weights[1]:g}; reference: {words}{dropout}"))
    return (preference.PreferenceLoss(model, "dpo", t.beta, autocast, reference),
            Decision("objective", "dpo", f"beta {t.beta:g}; reference: {words}{dropout}"))


def reference_for(model, full: bool):
    """(the reference, its description) of an objective that compares the policy with its start: under full
    fine-tuning a frozen copy made here, before any step, so the probe counts its memory; else the adapter's
    starting values, put back for the reference pass (preference.StartingAdapter: the same computation as the
    policy's, compiled or not); a prompt-learning adapter, whose start is not the base, switched off."""
    if full:
        return preference.reference_copy(model), "a frozen copy of the starting weights"
    if methods.is_prompt_learning(model):
        return None, "the base with the adapter off (no copy)"
    return preference.StartingAdapter(model), "the base: the adapter at its starting values (no copy of the base)"


def task_scores(model, tok, groups: list[tuple[str, list]], cfg: RunConfig, out: Path, device: torch.device,
                autocast: torch.dtype | None) -> dict[str, Any]:
    """The trained model's answers to each dataset's held-out rows, scored (ROUGE-L, chrF, exact match, EOS
    rate) in the run's own prompt format: overall, and per dataset (rougeL/<name>, ...) when there are
    several. The answers go to eval_answers.jsonl. The model generates as it trained (inference.Placed): its
    weights as they are, under the run's autocast."""
    from tunebench.model import quality
    compiler.uncompile_blocks(model)
    model.config.use_cache = True
    rows = [r for _, group in groups for r in group]
    answers, seconds = quality.generate_answers(inference.Placed(model, tok, device, autocast), rows, cfg.data.template,
                                                cfg.evaluation.eval_max_new_tokens, seed=cfg.schedule.seed)
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
    train_idx, eval_idx = split(usable, d.eval_fraction, cfg.schedule.seed, d.max_samples, d.eval_samples)
    if len(train_idx) < cfg.effective_batch_size:
        held = f", {len(eval_idx)} held out for eval" if len(eval_idx) else ""
        lost = f", {dropped} {why}" if dropped else ""
        raise TunebenchError(
            f"dataset '{d.path}' leaves {len(train_idx)} training row(s) ({usable} usable{lost}{held}), fewer than one "
            f"effective batch of {cfg.effective_batch_size}; add rows or lower --effective-batch-size")


def save_final(model, tokenizer, out: Path, cfg: RunConfig, loaded: models.Loaded,
               weights: dict | None = None) -> list[Path]:
    """The model (or adapter) and tokenizer, each file written whole (durable.atomic_files); `weights`, a
    sharded model's gathered state dict. Returns the files written."""
    with atomic_files(out) as tmp:
        if cfg.adapter.method == "full":
            model.save_pretrained(tmp, state_dict=weights)
        else:
            model.peft_config["default"].base_model_name_or_path = loaded.path or cfg.model.name
            model.save_pretrained(tmp, save_embedding_layers=False)  # "auto" would look the base up on the hub
        tokenizer.save_pretrained(tmp)
        return landing(tmp, out)
