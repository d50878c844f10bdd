"""Pretraining's configuration: its own `model` (the architecture) and `data` sections beside the eight
every run shares (schema.py). The CPU training guide's files and Python API work as written: its
`training:` section and top-level `device:` are the shared sections' keys in its spellings, and its
`TrainingConfig` is a view that keeps what it is given and reads it through the schema.
Cross-field rules are checked once, in `validate`, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunebench.core.batch_rule import launched_world_size
from tunebench.core.errors import TunebenchError
from tunebench.machine import hardware
from tunebench.settings import schema
from tunebench.settings.yamlfiles import parse_override, read_yaml

ACTIVATIONS = ("gelu", "gelu_exact", "relu", "swish", "swiglu")
SPLITS = ("random", "tail")  # data.split: seeded random blocks, or the last validation_split of the corpus


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
    # The guide's switch, read as hardware.gradient_checkpointing (true: on, false: off); None: not given.
    gradient_checkpointing: bool | None = None

    def copy(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def parameter_count(self) -> int:
        """Parameters of the model model/arch.build makes of this section, by formula (a test checks it against
        the built model): read before anything is built, by the size check at load and by the run's records."""
        d, f, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        head = 0 if self.tie_embeddings else V * d
        if self.use_learned_pos_emb:  # GPT-2: every matmul has a bias, LayerNorms have weight and bias
            attn = d * 3 * d + 3 * d + d * d + d
            mlp = d * f + f + f * d + d
            return V * d + self.max_seq_len * d + L * (attn + mlp + 4 * d) + 2 * d + head
        attn = 4 * d * d + (4 * d if self.use_bias else 0)  # Llama: q, k, v, o
        mlp = 3 * d * f + (2 * f + d if self.use_bias else 0)  # gate, up, down
        return V * d + L * (attn + mlp + 2 * d) + d + head


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


@dataclass(frozen=True)
class PretrainRun(schema.RunBase):
    """A pretraining run's whole configuration: the shared sections, then its model (the architecture) and data.
    With no effective batch given, the CPU guide's batch_size x gradient_accumulation_steps in each process
    (default_effective None)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return SCHEMA.to_dict(self)

    @property
    def data_files(self) -> list[str]:
        d = self.data
        return [f.strip() for f in d.train_file.split(",") if f.strip()] if d.train_file else [d.dataset_name]


def _files(value: Any) -> str | None:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return schema.coerce_value("data.train_file", value, str | None)


SECTIONS = {"model": ModelConfig, "data": DataConfig, **schema.SHARED}
SCHEMA = schema.Schema(
    "pretrain", SECTIONS, choices={"model.activation": ACTIVATIONS, "data.split": SPLITS},
    # the CPU guide's defaults where they are not fine-tuning's
    defaults={"batch.micro_batch_size": 8, "optimizer.lr": 3e-4, "optimizer.weight_decay": 0.1,
              "schedule.warmup_ratio": 0.0, "output.output_dir": "runs/pretrain", "output.save_steps": 500,
              "output.save_total_limit": 3, "evaluation.eval_steps": 500, "logging.logging_steps": 10,
              "hardware.gradient_checkpointing": "off", "evaluation.sample_tokens": 64},
    # the guide's top-level `device:` (or `device: {type: cpu}`) and its model's checkpointing switch
    aliases={"device": "hardware.device", "device.type": "hardware.device",
             "model.gradient_checkpointing": "hardware.gradient_checkpointing",
             "model.use_gradient_checkpointing": "hardware.gradient_checkpointing"},
    hints={"hidden_size": "d_model", "num_layers": "n_layers", "num_heads": "n_heads", "seq_len": "max_seq_len"},
    converters={"data.train_file": _files})


class TrainingConfig:
    """The CPU guide's TrainingConfig, as its code uses it: keyword arguments and attributes in its spellings
    (`batch_size`, `learning_rate`, `use_amp`, `checkpoint_dir`, `num_epochs`, `distributed_backend`,
    `world_size`...) or tunebench's, mutable. It keeps what it is given, refuses an unknown or mistyped key
    at once, and reads every value through the schema (with pretraining's defaults)."""

    def __init__(self, **given: Any):
        object.__setattr__(self, "_given", {})
        for name, value in given.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        SCHEMA.resolve(f"training.{name}", value)  # unknown or mistyped: refused now, naming the key
        self._given[name] = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        key = SCHEMA.key_of(f"training.{name}")
        if key is None:
            raise AttributeError(f"TrainingConfig has no '{name}'{SCHEMA.nearest(f'training.{name}')}")
        section, field_ = key.split(".")
        value = SCHEMA.fill([self.given()])[section].get(field_, getattr(SECTIONS[section](), field_))
        return value == "amp" if name == "use_amp" else value == name if name in schema.PRECISION_ALIASES else value

    def __repr__(self) -> str:
        return f"TrainingConfig({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def given(self) -> dict[str, Any]:
        return {f"training.{k}": v for k, v in self._given.items()}

    def copy(self, **changes: Any) -> "TrainingConfig":
        return TrainingConfig(**{**self._given, **changes})

    def get_effective_device(self) -> str:
        """The device a run would train on here (the guide's `config.get_effective_device()`)."""
        return "cpu" if self.force_cpu else self.resolve_device()[0]

    def resolve_device(self) -> tuple[str, str]:
        """(device, reason) that `device` resolves to on this machine, as a run would pick it."""
        d = hardware.plan(self.device, "auto", hardware.detect()).decision("device")
        return str(d.value), d.reason


@dataclass
class PretrainConfig:
    """The CPU guide's trio, mutable as its code uses it (`base_config.copy()`, then a field changed);
    `resolve()` is the run it describes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def copy(self) -> "PretrainConfig":
        """An independent copy: changing it leaves this one as it is."""
        return PretrainConfig(self.model.copy(), self.training.copy(), self.data.copy())

    def resolve(self, world_size: int | None = None) -> PretrainRun:
        model = dataclasses.asdict(self.model)
        layer = {f"model.{k}": v for k, v in model.items() if v is not None}
        layer |= {f"data.{k}": v for k, v in dataclasses.asdict(self.data).items()}
        return load(None, {**layer, **self.training.given()}, world_size=world_size)


SHIPPED_DIR = Path(__file__).parents[1] / "configs" / "pretrain"


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
         overrides: list[str] | None = None, world_size: int | None = None) -> PretrainRun:
    """Defaults < YAML < options (dotted keys) < dotted overrides; then validate, at the number of processes
    the run will have (`world_size`; default torchrun's WORLD_SIZE, else 1)."""
    layers = [SCHEMA.flatten(read_yaml(config_path(yaml_path)), str(yaml_path))] if yaml_path is not None else []
    layers += [dict(options or {}), dict(parse_override(o) for o in overrides or [])]
    cfg = PretrainRun(**SCHEMA.build(SCHEMA.fill(layers)))
    validate(cfg, world_size)
    return cfg


def validate(cfg: PretrainRun | PretrainConfig, world_size: int | None = None) -> PretrainRun:
    """`cfg` checked (the guide's trio resolved first); the run it describes."""
    if isinstance(cfg, PretrainConfig):
        return cfg.resolve(world_size)
    SCHEMA.check(cfg)
    world_size = world_size or launched_world_size()
    schema.check_shared(cfg, world_size, "pretrain")
    m, d, h, e = cfg.model, cfg.data, cfg.hardware, cfg.evaluation
    if e.sample_tokens is None:  # fine-tuning's sections leave it unset; pretraining samples at each evaluation
        raise TunebenchError("evaluation.sample_tokens is null; give the number of tokens each sample takes, or leave "
                             "the key out for pretraining's default")
    positive = {"model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.n_heads": m.n_heads,
                "model.n_layers": m.n_layers, "model.d_ff": m.d_ff, "model.max_seq_len": m.max_seq_len,
                "data.max_length": d.max_length}
    if d.max_eval_blocks is not None:
        positive["data.max_eval_blocks"] = d.max_eval_blocks
    for name, value in positive.items():
        if value <= 0:
            raise TunebenchError(f"{name} must be positive, got {value}")
    if m.d_model % m.n_heads:
        raise TunebenchError(f"model.d_model {m.d_model} is not divisible by model.n_heads {m.n_heads}; "
                             f"pick n_heads among {', '.join(str(h) for h in range(1, 33) if m.d_model % h == 0)}")
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
                    ("data.validation_split", d.validation_split)):
        if not 0 <= p < 1:
            raise TunebenchError(f"{name} must be in [0, 1), got {p}")
    check_size(m, world_size)
    if d.max_length > m.max_seq_len:
        raise TunebenchError(f"data.max_length {d.max_length} exceeds model.max_seq_len {m.max_seq_len}; lower "
                             "data.max_length or raise model.max_seq_len")
    if m.init_std <= 0 or m.layer_norm_eps <= 0:
        raise TunebenchError("model.init_std and model.layer_norm_eps must be positive")
    if not d.pack_sequences:
        raise TunebenchError("data.pack_sequences: false is not supported: tunebench pretrains on blocks of "
                             "data.max_length tokens cut from the concatenated documents; set pack_sequences: true")
    if not d.train_file and not d.dataset_name:
        raise TunebenchError("no training data: pass --data FILE (data.train_file) or data.dataset_name")
    if cfg.batch.micro_batch_size is None and cfg.batch.effective_batch_size is None:
        raise TunebenchError("training.batch_size auto needs training.effective_batch_size (the micro batches "
                             "measured are those that divide it)")
    if h.liger == "on":
        raise TunebenchError("hardware.liger on: Liger's kernels patch the Hugging Face models fine-tuning loads; "
                             "pretraining builds its own, so leave liger on auto")
    if e.eval_generate:
        raise TunebenchError("evaluation.eval_generate scores answers to held-out prompts, and pretraining's "
                             "validation data is plain text; use evaluation.sample_prompt for samples as it trains")
    cfg.batch_ask().check(world_size)
    return cfg


TRAIN_BYTES_PER_PARAMETER = 16  # fp32 weights, their gradients and AdamW's two moments


def check_size(m: ModelConfig, world_size: int) -> None:
    """Refuse, at load, an architecture whose training cannot fit this machine's memory (d_model=2**40 used to
    end in the allocator): its parameters x 16 bytes, shared by the processes (FSDP shards them), against the
    machine's RAM. Activations come on top."""
    import psutil

    params = m.parameter_count()
    need, have = params * TRAIN_BYTES_PER_PARAMETER / world_size, psutil.virtual_memory().total
    if need > have:
        raise TunebenchError(f"the model section makes about {params:,} parameters, whose training needs about "
                             f"{need / 2**30:,.0f} GiB per process (weights, gradients, AdamW moments) and this "
                             f"machine has {have / 2**30:,.0f} GiB; lower model.d_model, d_ff, n_layers or vocab_size")


