"""A base model with its fine-tuning method applied, as the fine-tuning recipes (SFT, DPO/ORPO/KTO, GRPO) load,
build, place and save it: its identity for a resume, the memory check before loading, the method (LoRA and the
other PEFT methods, QLoRA, full), the parallel layout, the preference objective's loss and reference, the final
weights. jobs/finetune.py and jobs/grpo.py share it (finetune_data.py: the rows; finetune_report.py: what is said)."""


import dataclasses
from pathlib import Path
from typing import Any

import torch

from tunebench.core.decision import Decision
from tunebench.core.durable import atomic_files, landing
from tunebench.core.errors import TunebenchError
from tunebench.core.precision import DTYPES
from tunebench.jobs.parts import runner
from tunebench.machine import hardware, metrics
from tunebench.model import methods, models
from tunebench.settings import objectives, schema
from tunebench.settings.finetune import ObjectiveKeys, RunConfig, not_sharded
from tunebench.training import preference
from tunebench.training.autotune import Trained, memory
from tunebench.training.autotune.probe import enable_checkpointing, memory_free_mb


def identity(cfg: RunConfig, **extra) -> dict[str, Any]:
    """What a resume of this run must match: the model, the adapter's settings, the seed, the data."""
    d = cfg.data
    plain = cfg.to_dict()
    # the adapter and the objective as one, as a checkpoint from before the objective had its own section saved it:
    # every objective key, None where not this objective's (as before its settings were typed); the keys added
    # since (the episodes', the kind column, RFT's, the turn credit) only where set away from what the runs before
    # them did, so that such a checkpoint still matches
    keys = tuple(f.name for f in dataclasses.fields(ObjectiveKeys) if f.name != "name")
    later = {"environment": None, **dict.fromkeys(objectives.EPISODE_DEFAULTS), "kind_column": None,
             "min_reward": None, "turn_credit": "pooled", "resample_alike": 0, "balance_kinds": False,
             "weigh_kinds": False, "num_iterations": 1, "negative_weight": 1.0}
    every = schema.plain(objectives.every_key(cfg.objective, keys))
    adapter = {**plain["adapter"], **{"objective" if k == "name" else k: v for k, v in every.items()
                                      if k not in later or v not in (None, later[k])}}
    return {"model": cfg.model.name, "adapter": adapter, "seed": cfg.schedule.seed,
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
        model = methods.load_quantized(loaded, cfg.model.name, a.quantization, compute, cfg.model.allow_download)
        methods.prepare_for_kbit(model)  # the embeddings and head stay 16-bit (PEFT's own casts them to fp32)
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


def trainable_model(cfg: RunConfig, loaded: models.Loaded, opened: runner.Opened):
    """(model with its method applied, the preference loss or None, its settings rows, (trainable, total)
    parameters); refused when nothing would train."""
    model, rows = build_model(cfg, loaded, opened.hw_plan.precision, opened.device)
    autocast = opened.autocast
    model.config.use_cache = False
    if cfg.hardware.gradient_checkpointing == "on":
        enable_checkpointing(model)
    loss_module = None
    if cfg.objective.preference:
        loss_module, row = preference.loss_for(model, cfg.objective, cfg.adapter.method == "full", autocast)
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
    if parallel.value == "fsdp":  # asked for (refused at load too), or auto's pick for a model no rank can hold
        if refused := not_sharded(cfg):
            raise TunebenchError(refused)
    return parallel


def fixed_micro_batch(opened: runner.Opened, o: objectives.Objective) -> dict[str, Any]:
    """KTO's micro batch is part of its math (its KL reference point is estimated over each one, as over TRL's
    per-device batch), so the probe never picks it: the whole effective batch on each rank, unless asked."""
    if not o.micro_batch_in_math:
        return {}
    why = ("KTO estimates its KL reference point over each micro batch (TRL's per-device batch; all ranks' rows "
           "together), so it is not measured")
    if opened.ask.micro:
        return {"asked_reason": f"asked for; {why}"}
    return {"micro": opened.effective // opened.world.size,
            "asked_reason": f"the effective batch: {why}; --batch-size N estimates it over N rows instead"}


def measured_as(cfg: RunConfig) -> Trained:
    """What is trained, as the measurement cache keys it: a preference step is a pair's two rows plus DPO's
    reference pass, measured apart from SFT's rows."""
    a = cfg.adapter
    return Trained(cfg.model.name, cfg.objective.measured_as(a.method), a.quantization,
                   a.num_virtual_tokens if a.method in methods.PROMPT_METHODS else a.r, a.target_modules)


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
