"""The pretraining schema, in the CPU training guide's own key names, so its YAML files load unchanged.

Sections: `device` (a string), `model` (the architecture), `training`, `data`. Precedence, lowest
first: dataclass defaults, the YAML file, command-line options, dotted overrides
(`training.learning_rate=1e-3`). Unknown keys name the nearest valid one; cross-field rules are
checked once, in `validate`, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tunebench.config import SCHEDULES, _coerce, check_threads, check_types, nearest_key, parse_override, read_yaml
from tunebench.errors import TunebenchError
from tunebench.batch_rule import BatchAsk, launched_world_size

ACTIVATIONS = ("gelu", "gelu_exact", "relu", "swish", "swiglu")


PRETRAIN_BATCH_FLAGS = ("training.effective_batch_size", "training.batch_size", "training.gradient_accumulation_steps")


@dataclass
class ModelConfig:
    """A decoder-only transformer. Learned positions build a GPT-2-style model (LayerNorm, plain MLP);
    rotary positions a Llama-style one (RMSNorm, gated MLP: activation swiglu)."""

    vocab_size: int = 32000
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    max_seq_len: int = 512
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"  # gelu (tanh form) | gelu_exact (erf) | relu | swish (GPT-2-style) | swiglu (Llama-style)
    pre_norm: bool = True
    use_bias: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    use_learned_pos_emb: bool = True
    tie_embeddings: bool = True
    gradient_checkpointing: bool = False

    def copy(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class TrainingConfig:
    device: str = "auto"  # auto | cpu | cuda | mps (the YAML's top-level `device:` lands here)
    threads: int | None = None  # torch's CPU threads; None: OMP_NUM_THREADS, else the usable physical cores
    parallel: str = "auto"  # under torchrun: auto | ddp | fsdp (FSDP2: weights, gradients and moments sharded)
    backend: str = "auto"  # torch.distributed backend under torchrun: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    batch_size: int = 8  # micro batch; `auto` measures the sizes that divide the effective batch
    autotune_batch: bool = False  # set by batch_size: auto
    effective_batch_size: int | None = None  # default: batch_size x gradient_accumulation_steps
    learning_rate: float = 3e-4
    weight_decay: float = 0.1
    num_epochs: float = 1.0
    max_steps: int | None = None
    max_tokens: int | None = None  # a token budget: the steps that train on about this many tokens
    lr_scheduler: str = "cosine"  # cosine | linear | constant | warmup_stable_decay
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    optimizer: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999  # 0.99 suits small models and batches (nanoGPT's character-level recipe)
    gradient_accumulation_steps: int | None = None  # None: not given (1, or derived from effective_batch_size)
    use_amp: bool | None = None  # true: 16-bit autocast (bf16 where the hardware has it); false: fp32
    fp16: bool = False
    bf16: bool = False
    precision: str = "auto"  # tunebench's own key: auto | fp32 | bf16 | fp16 (the three above override it)
    save_steps: int | None = 500
    save_total_limit: int = 3
    eval_steps: float | None = 500  # every N steps; below 1, a share of the run's steps (0.25: 4 evals)
    logging_steps: int = 10
    max_grad_norm: float = 1.0
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    checkpoint_dir: str = "runs/pretrain"  # the run's output directory
    seed: int = 42
    report_to: str = "none"  # none | tensorboard
    compile: str = "auto"  # auto | on | off
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune
    attention: str = "auto"  # auto | sdpa | eager | tunebench | flash_attention_2
    resume: str | None = None  # auto | a checkpoint directory
    overwrite: bool = False
    progress: bool = True
    monitor: bool = True
    sample_prompt: str | None = None  # generations at each eval start from this (default: validation text)
    sample_tokens: int = 64
    # The CPU training guide's API, taken as it is written:
    force_cpu: bool = False  # train on the CPU whatever `device` says
    logging_dir: str | None = None  # where report_to: tensorboard writes (default: RUN_DIR/tensorboard)
    dataloader_prefetch_factor: int | None = None  # accepted; batches are slices of an in-memory token file
    distributed_backend: str | None = None  # the guide's name for `backend`
    # The guide's: the number of processes the run is started with (torchrun, tunebench launch). A config
    # cannot start processes; a run started with another number is refused, with the command that starts it.
    world_size: int | None = None

    def __post_init__(self):
        if isinstance(self.report_to, (list, tuple)):  # HF TrainingArguments' spelling: report_to=["tensorboard"]
            unknown = [r for r in self.report_to if r not in ("tensorboard", "none")]
            if unknown:
                raise TunebenchError(f"training.report_to {unknown} is not supported; tensorboard or none")
            self.report_to = "tensorboard" if "tensorboard" in self.report_to else "none"

    def get_effective_device(self) -> str:
        """The device a run would train on here (the guide's `config.get_effective_device()`)."""
        return "cpu" if self.force_cpu else self.resolve_device()[0]

    def copy(self, **changes: Any) -> "TrainingConfig":
        return dataclasses.replace(self, **changes)

    def resolve_device(self) -> tuple[str, str]:
        """(device, reason) that `device` resolves to on this machine, as a run would pick it."""
        from tunebench import hardware

        d = hardware.plan(self.device, "auto", hardware.detect()).decision("device")
        return str(d.value), d.reason

    @property
    def precision_request(self) -> str:
        """What the precision keys ask for: auto, fp32, bf16, fp16, or amp (16-bit where the hardware has it)."""
        if self.bf16:
            return "bf16"
        if self.fp16:
            return "fp16"
        if self.use_amp is True:
            return "amp" if self.precision == "auto" else self.precision
        if self.use_amp is False:
            return "fp32"
        return self.precision


@dataclass
class DataConfig:
    train_file: str | None = None  # text, JSONL/JSON/CSV/Parquet, a save_to_disk dir; several: comma-separated
    validation_file: str | None = None  # default: data.validation_split of the training blocks
    dataset_name: str | None = None  # a dataset already in the local Hugging Face cache
    dataset_config: str | None = None
    text_column: str = "text"
    max_length: int = 512  # tokens per block
    vocab_size: int | None = None  # of the tokenizer trained when data.tokenizer is unset (default: model's)
    tokenizer: str | None = None  # a tokenizer directory; unset: byte-level BPE trained on the training data
    pack_sequences: bool = True  # documents are concatenated (EOS between them) and cut into blocks
    preprocessing_num_workers: int | None = None  # tokenizer threads (default: the CPU's cores)
    validation_split: float = 0.1
    split: str = "random"  # random (seeded blocks) | tail (the last validation_split of the corpus)
    max_eval_blocks: int | None = None  # cap on validation blocks per evaluation
    cache_dir: str | None = None  # where tokenized data is cached (default: tunebench's cache, ~/.cache/tunebench)

    def copy(self, **changes: Any) -> "DataConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def copy(self) -> "PretrainConfig":
        """An independent copy (the guide's `base_config.copy()`): changing it leaves this one as it is."""
        return PretrainConfig(self.model.copy(), self.training.copy(), self.data.copy())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def batch_ask(self) -> BatchAsk:
        """What the batch keys ask for (runplan holds the rule): the effective batch is
        training.effective_batch_size, else batch_size x gradient_accumulation_steps, at any world size."""
        t = self.training
        if t.effective_batch_size is None:  # batch_size x accumulation, however many ranks split it
            return BatchAsk(t.batch_size * (t.gradient_accumulation_steps or 1),
                            None if t.autotune_batch else t.batch_size, None, PRETRAIN_BATCH_FLAGS)
        # all three given: they must agree (checked at the world size), never one of them dropped
        return BatchAsk(t.effective_batch_size, None if t.autotune_batch else t.batch_size,
                        t.gradient_accumulation_steps,
                        PRETRAIN_BATCH_FLAGS)

    @property
    def effective_batch_size(self) -> int:
        return self.batch_ask().effective_for(1)

    @property
    def data_files(self) -> list[str]:
        d = self.data
        return [f.strip() for f in d.train_file.split(",") if f.strip()] if d.train_file else [d.dataset_name]


SECTIONS = {"model": ModelConfig, "training": TrainingConfig, "data": DataConfig}
ALIASES = {"train": "training", "lr": "learning_rate", "epochs": "num_epochs", "micro_batch_size": "batch_size",
           "grad_accum_steps": "gradient_accumulation_steps", "output_dir": "checkpoint_dir", "schedule": "lr_scheduler",
           "hidden_size": "d_model", "num_layers": "n_layers", "num_heads": "n_heads", "seq_len": "max_seq_len"}


# The hardware guide's keys, translated at load: its optimization section is our training section's, and
# its model.use_gradient_checkpointing is model.gradient_checkpointing.
KEY_ALIASES = {"optimization.compile": "training.compile",
               "optimization.gradient_accumulation_steps": "training.gradient_accumulation_steps",
               "model.use_gradient_checkpointing": "model.gradient_checkpointing"}


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)] + ["device"]


def _nearest(key: str) -> str:
    return nearest_key(key, all_keys(), ALIASES, "tunebench pretrain --help")


def _set(tree: dict[str, dict[str, Any]], key: str, value: Any) -> None:
    if key == "device":
        key = "training.device"
        if isinstance(value, dict):  # device: {type: cpu}
            value = next((value[k] for k in ("type", "device", "name") if k in value), None)
    key = KEY_ALIASES.get(key, key)
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS or parts[1] not in {f.name for f in dataclasses.fields(SECTIONS[parts[0]])}:
        raise TunebenchError(f"unknown config key '{key}'{_nearest(key)}")
    if key == "training.batch_size" and str(value).lower() == "auto":
        tree["training"]["autotune_batch"] = True
        return
    if key == "data.train_file" and isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    tree[parts[0]][parts[1]] = _coerce(key, value, SECTIONS[parts[0]])


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, values in raw.items():
        if section == "device" or not isinstance(values, dict):
            out[section] = values
        else:
            out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


SHIPPED_DIR = Path(__file__).parent / "configs" / "pretrain"


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def config_path(spec: str | Path) -> Path:
    """A YAML path, or the name of a shipped config (cpu_small_model, cpu_medium_model, gpu_model)."""
    path = Path(spec)
    if path.exists():
        return path
    if (SHIPPED_DIR / f"{path.stem}.yaml").is_file() and (path.suffix in ("", ".yaml", ".yml")):
        # the guide's `--config configs/cpu_small_model.yaml`: its file by name, shipped with tunebench
        if path.suffix:
            print(f"config: {spec} is not here; using tunebench's shipped {path.stem} ({SHIPPED_DIR / path.name})")
        return SHIPPED_DIR / f"{path.stem}.yaml"
    if path.suffix in (".yaml", ".yml"):
        return path
    raise TunebenchError(f"config '{spec}' is neither a YAML file nor a shipped config ({', '.join(shipped())})")


def load(yaml_path: str | Path | None = None, options: dict[str, Any] | None = None,
         overrides: list[str] | None = None, world_size: int | None = None) -> PretrainConfig:
    """Defaults < YAML < options (dotted keys) < dotted overrides; then validate, at the number of processes
    the run will have (`world_size`; default torchrun's WORLD_SIZE, else 1)."""
    tree: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    layers = [_flatten(read_yaml(config_path(yaml_path)))] if yaml_path is not None else []
    layers += [dict(options or {}), dict(parse_override(o) for o in overrides or [])]
    for layer in layers:
        for key, value in layer.items():
            _set(tree, key, value)
    cfg = PretrainConfig(**{s: cls(**tree[s]) for s, cls in SECTIONS.items()})
    validate(cfg, world_size)
    return cfg


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise TunebenchError(f"{key} '{value}' is not one of {', '.join(map(str, allowed))}; pick one of those")


def validate(cfg: PretrainConfig, world_size: int | None = None) -> None:
    check_types(cfg, SECTIONS)
    m, t, d = cfg.model, cfg.training, cfg.data
    positive = {"model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.n_heads": m.n_heads,
                "model.n_layers": m.n_layers, "model.d_ff": m.d_ff, "model.max_seq_len": m.max_seq_len,
                "training.batch_size": t.batch_size,
                "training.logging_steps": t.logging_steps, "training.save_total_limit": t.save_total_limit,
                "data.max_length": d.max_length, "training.sample_tokens": t.sample_tokens}
    if t.max_steps is not None and t.max_tokens is not None:
        raise TunebenchError("training.max_steps and training.max_tokens both set the run's length; give one of them")
    for opt in ("max_steps", "max_tokens", "eval_steps", "save_steps", "effective_batch_size", "threads",
                "gradient_accumulation_steps", "world_size"):
        if getattr(t, opt) is not None:
            positive[f"training.{opt}"] = getattr(t, opt)
    if d.max_eval_blocks is not None:
        positive["data.max_eval_blocks"] = d.max_eval_blocks
    for name, value in positive.items():
        if value <= 0:
            raise TunebenchError(f"{name} must be positive, got {value}")
    if m.d_model % m.n_heads:
        raise TunebenchError(f"model.d_model {m.d_model} is not divisible by model.n_heads {m.n_heads}; "
                             f"pick n_heads among {', '.join(str(h) for h in range(1, 33) if m.d_model % h == 0)}")
    _choice("model.activation", m.activation, ACTIVATIONS)
    if not m.pre_norm:
        raise TunebenchError("model.pre_norm: false (post-norm) has no standard Hugging Face causal LM to build on; "
                             "set pre_norm: true")
    if m.use_learned_pos_emb and m.activation == "swiglu":
        raise TunebenchError("model.activation swiglu is the Llama-style gated MLP, which uses rotary positions; "
                             "set use_learned_pos_emb: false, or pick gelu, gelu_exact, relu or swish for the "
                             "GPT-2-style model")
    if not m.use_learned_pos_emb and m.activation != "swiglu":
        raise TunebenchError(f"model.activation {m.activation} with rotary positions: the Llama-style model's MLP is "
                             "gated; set activation: swiglu, or use_learned_pos_emb: true for a GPT-2-style model")
    if m.use_learned_pos_emb and not m.use_bias:
        raise TunebenchError("model.use_bias: false needs the Llama-style model (use_learned_pos_emb: false, "
                             "activation: swiglu); GPT-2-style layers always have biases")
    for name, p in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout),
                    ("training.adam_beta1", t.adam_beta1), ("training.adam_beta2", t.adam_beta2),
                    ("data.validation_split", d.validation_split)):
        if not 0 <= p < 1:
            raise TunebenchError(f"{name} must be in [0, 1), got {p}")
    if d.max_length > m.max_seq_len:
        raise TunebenchError(f"data.max_length {d.max_length} exceeds model.max_seq_len {m.max_seq_len}; lower "
                             "data.max_length or raise model.max_seq_len")
    if t.learning_rate <= 0 or t.num_epochs <= 0:
        raise TunebenchError("training.learning_rate and training.num_epochs must be positive")
    _choice("training.device", t.device, ("auto", "cpu", "cuda", "mps"))
    _choice("training.lr_scheduler", t.lr_scheduler, SCHEDULES)
    _choice("training.optimizer", t.optimizer.lower(), ("adamw", "adamw_torch", "adamw_torch_fused"))
    _choice("training.precision", t.precision, ("auto", "fp32", "bf16", "fp16"))
    _choice("training.report_to", t.report_to, ("none", "tensorboard"))
    _choice("training.compile", t.compile, ("auto", "on", "off"))
    _choice("training.parallel", t.parallel, ("auto", "ddp", "fsdp"))
    _choice("training.backend", t.backend, ("auto", "gloo", "nccl"))
    _choice("training.compile_mode", t.compile_mode, ("default", "reduce-overhead", "max-autotune"))
    if t.distributed_backend is not None:
        _choice("training.distributed_backend", t.distributed_backend, ("gloo", "nccl"))
        if t.backend not in ("auto", t.distributed_backend):
            raise TunebenchError(f"training.backend '{t.backend}' and distributed_backend '{t.distributed_backend}' "
                                 "disagree; give one of them")
    if t.dataloader_prefetch_factor is not None and t.dataloader_prefetch_factor < 1:
        raise TunebenchError(f"training.dataloader_prefetch_factor must be 1 or more, got {t.dataloader_prefetch_factor}")
    _choice("training.attention", t.attention, ("auto", "sdpa", "eager", "tunebench", "flash_attention_2"))
    _choice("data.split", d.split, ("random", "tail"))
    if t.bf16 and t.fp16:
        raise TunebenchError("training.bf16 and training.fp16 are both true; set one of them")
    if not d.pack_sequences:
        raise TunebenchError("data.pack_sequences: false is not supported: tunebench pretrains on blocks of "
                             "data.max_length tokens cut from the concatenated documents; set pack_sequences: true")
    if not d.train_file and not d.dataset_name:
        raise TunebenchError("no training data: pass --data FILE (data.train_file) or data.dataset_name")
    if t.autotune_batch and t.effective_batch_size is None:
        raise TunebenchError("training.batch_size auto needs training.effective_batch_size (the micro batches "
                             "measured are those that divide it)")
    started = world_size or launched_world_size()
    if t.world_size is not None and t.world_size != started:
        raise TunebenchError(f"training.world_size is {t.world_size}, and this run was started as {started} "
                             f"process(es); start {t.world_size}: `tunebench launch --nproc-per-node {t.world_size} -- "
                             "pretrain ...` on one machine (--nnodes x --nproc-per-node across machines), or drop "
                             "world_size")
    cfg.batch_ask().check(started)
    if not 0 <= t.warmup_ratio <= 1:
        raise TunebenchError(f"training.warmup_ratio must be in [0, 1], got {t.warmup_ratio}")
    if t.warmup_steps < 0 or t.weight_decay < 0 or t.dataloader_num_workers < 0:
        raise TunebenchError("training.warmup_steps, weight_decay and dataloader_num_workers must be 0 or more")
    if t.max_grad_norm <= 0 or m.init_std <= 0 or m.layer_norm_eps <= 0:
        raise TunebenchError("training.max_grad_norm, model.init_std and model.layer_norm_eps must be positive")
    check_threads(t.threads, "training.threads (--threads)")


def dump_yaml(cfg: PretrainConfig, path: str | Path) -> None:
    from tunebench.durable import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
