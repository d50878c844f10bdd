"""The run configuration: frozen dataclasses are the schema, YAML and the command line hold values.

Precedence, lowest first: dataclass defaults, the YAML file, command-line options, dotted
overrides (`train.lr=1e-4`). Unknown keys are errors that name the nearest valid key;
cross-field rules are checked once, in `validate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tunebench.errors import TunebenchError
from tunebench.batch_rule import BatchAsk, launched_world_size

DEFAULT_MODEL = "smollm2-135m-instruct"
BUILTIN_DATA = "builtin:customer-support"
METHODS = ("lora", "qlora", "dora", "ia3", "loha", "lokr", "prefix", "prompt", "full")
OBJECTIVES = ("sft", "dpo", "orpo")  # next-token loss on the replies | preference pairs (data.pairs)
SCHEDULES = ("cosine", "linear", "constant", "warmup_stable_decay")  # transformers.get_scheduler's (optim.lr_factor)


@dataclass(frozen=True)
class ModelConfig:
    name: str = DEFAULT_MODEL  # preset, hub id, local HF directory or .gguf file
    tokenizer: str | None = None  # defaults to the model's own
    allow_download: bool = False  # tunebench never reaches the hub unless asked


@dataclass(frozen=True)
class DataConfig:
    path: str = BUILTIN_DATA
    format: str = "auto"  # auto | instruction | alpaca | question (question+answer, GSM8K) | chat | text
    instruction_column: str = "instruction"
    input_column: str = "input"
    response_column: str = "response"
    messages_column: str = "messages"
    text_column: str = "text"
    template: str = "auto"  # auto (chat template when the tokenizer has one) | a format string
    train_on: str = "response"  # response | all
    max_length: int = 128
    packing: str = "auto"  # auto (packed or length-grouped rows when they remove padding) | on | off
    max_samples: int | None = None
    eval_fraction: float = 0.05
    eval_samples: int | None = None  # cap on eval rows (after the split)
    # several datasets in one run: ((path, mixture weight), ...); each is formatted and split on its own,
    # and training draws from them in proportion to the weights. Empty: `path` alone.
    sources: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class AdapterConfig:
    method: str = "lora"  # lora | qlora | dora | ia3 | loha | lokr | prefix | prompt | full
    r: int = 8  # rank: lora, qlora, dora, loha, lokr
    lora_alpha: int = 16  # scaling alpha: lora, qlora, dora, loha, lokr
    lora_dropout: float = 0.1  # lora, qlora, dora
    target_modules: str = "auto"  # auto | comma-separated module names | all-linear (the weight methods)
    quantization: str = "none"  # none | 4bit | 8bit (lora/qlora)
    num_virtual_tokens: int = 20  # prefix, prompt
    prompt_init_text: str | None = None  # prompt: start the virtual tokens from this text's embeddings


DEFAULT_EFFECTIVE_BATCH = 8  # rows per optimizer step when no batch flag says otherwise (the study's 8)


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = "runs/latest"
    epochs: float = 1.0
    max_steps: int | None = None
    max_tokens: int | None = None  # a token budget: the steps that train on about this many real tokens
    micro_batch_size: int = 4
    autotune_batch: bool = True  # measure candidate micro batches, keep the fastest (off once a size is given)
    grad_accum_steps: int | None = None  # derived from effective_batch_size when unset
    # None: not given, so 8 (DEFAULT_EFFECTIVE_BATCH), or micro x accumulation x ranks when both of those are
    # given. A value is a request even when it is 8: whether it was given is what it holds, never its value.
    effective_batch_size: int | None = None
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    schedule: str = "cosine"  # cosine | linear | constant | warmup_stable_decay (transformers' formulas)
    max_grad_norm: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda | mps
    threads: int | None = None  # torch's CPU threads; None: OMP_NUM_THREADS, else the physical cores this process may use
    parallel: str = "auto"  # under torchrun: auto | ddp | fsdp (FSDP2 shards full fine-tuning)
    backend: str = "auto"  # torch.distributed backend under torchrun: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    compile: str = "auto"  # auto | on | off (torch.compile)
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune
    attention: str = "auto"  # auto (the fastest measured) | sdpa | eager | tunebench | flash_attention_2 (CUDA, flash-attn)
    liger: str = "auto"  # auto (on a CUDA GPU when liger-kernel is installed and knows the model) | on | off
    gradient_checkpointing: str = "auto"  # auto (only when the batch would not fit otherwise) | on | off
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr when the effective batch differs from lr_reference_batch
    lr_reference_batch: int = 8
    monitor: bool = True  # background sampler of CPU/RAM/GPU use
    seed: int = 42
    logging_steps: int | None = None  # None: every step on a CPU, every 10 on a GPU (each read of the loss is a sync)
    eval_steps: float | None = None  # every N steps; below 1, a share of the run's steps (0.25: 4 evals); None: at the end
    save_steps: int | None = None  # None: checkpoint only at the end and on interrupt
    eval_generate: int = 0  # at the end, answer this many held-out rows and score them (tunebench.quality)
    eval_max_new_tokens: int = 128  # the cap on each of those answers
    save_total_limit: int = 2
    resume: str | None = None  # auto | PATH to a checkpoint directory
    overwrite: bool = False  # replace an earlier run in output_dir (never implied)
    report_to: str = "none"  # none | tensorboard
    progress: bool = True
    objective: str = "sft"  # sft | dpo | orpo (preference pairs; `--method dpo` is DPO with LoRA)
    beta: float = 0.1  # DPO's beta: how far the policy may move from its reference (the paper's default)
    orpo_lambda: float = 0.1  # ORPO's lambda: the weight of the odds-ratio term (the paper's; TRL calls it beta)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["data"]["sources"] = [{"path": p, "weight": w} for p, w in self.data.sources]  # YAML has no tuples
        return d

    def batch_ask(self) -> BatchAsk:
        """What the batch options ask for (runplan holds the rule): an explicit --grad-accum with a micro
        batch is taken as asked (effective = micro x accumulation x world size, HF Trainer's reading of
        per-device batch and accumulation); otherwise --effective-batch-size is kept at any world size."""
        t = self.train
        effective = t.effective_batch_size
        if effective is None and t.grad_accum_steps is None:
            effective = DEFAULT_EFFECTIVE_BATCH
        return BatchAsk(effective, None if t.autotune_batch else t.micro_batch_size, t.grad_accum_steps)

    @property
    def effective_batch_size(self) -> int:
        """Rows per optimizer step in one process."""
        return self.batch_ask().effective_for(1)


_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "adapter": AdapterConfig, "train": TrainConfig}


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)]


# Spellings from the documents users arrive with, translated at load (they are not fields of the schema):
# the hardware guide's Hydra overrides `training.batch_size=20 optimization.compile=true
# model.use_gradient_checkpointing=true`, and its optimization section's accumulation.
KEY_ALIASES = {"training.batch_size": "train.micro_batch_size", "optimization.compile": "train.compile",
               "optimization.gradient_accumulation_steps": "train.grad_accum_steps",
               "model.use_gradient_checkpointing": "train.gradient_checkpointing"}

# Names other tools use for our keys, so the hint lands on the right one.
SYNONYMS = {
    "learning_rate": "lr", "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "num_epochs": "epochs", "num_train_epochs": "epochs", "gradient_accumulation_steps": "grad_accum_steps",
    "max_seq_length": "max_length", "lora_r": "r", "rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
    "model_name": "name", "dataset": "path", "lora": "adapter", "training": "train", "dataset_path": "path",
}


def _nearest(key: str) -> str:
    return nearest_key(key, all_keys(), SYNONYMS, "tunebench train --help")


def nearest_key(key: str, keys: list[str], synonyms: dict[str, str], help_command: str) -> str:
    """'; did you mean ...?' for an unknown dotted key: by the whole key, else by its last part (other
    tools' names for a key, `synonyms`, count as that key)."""
    key = ".".join(synonyms.get(part, part) for part in key.split("."))
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
    by_leaf.update({alias: by_leaf[target] for alias, target in synonyms.items() if target in by_leaf})
    hit = difflib.get_close_matches(key, keys, n=1, cutoff=0.75) or [
        by_leaf[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.6)
    ]
    return f"; did you mean '{hit[0]}'?" if hit else f"; run `{help_command}` for the valid keys"


ON_OFF_FIELDS = ("compile", "packing", "liger", "gradient_checkpointing")  # auto | on | off, in both schemas
TYPE_WORDS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def _coerce(key: str, value: Any, cls: type | None = None) -> Any:
    """Turn a YAML/CLI value into the declared type of field `key` (section.name) of `cls`, or raise naming the key.

    Strict on purpose: a value that only looks right (a list for a number, `true` for a step count,
    an infinite learning rate) is refused here, at load, with the fix, never carried into a run."""
    section, name = key.split(".")
    cls = cls or _SECTION_TYPES[section]
    if key == "data.sources":
        return _sources(value)
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    optional = type(None) in args or (isinstance(hint, types.UnionType) and type(None) in args)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None or (isinstance(value, str) and value.lower() in {"none", "null"} and base is not str):
        if optional:
            return None
        raise TunebenchError(f"config key '{key}' cannot be empty; give it {TYPE_WORDS.get(base, base.__name__)}")
    if isinstance(value, (list, tuple, dict, set)):
        raise TunebenchError(f"config key '{key}' takes one value ({TYPE_WORDS.get(base, base.__name__)}), got a "
                             f"{type(value).__name__} ({_short(value)}); give a single value")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in {"true", "1", "yes", "on"}:
                return True
            if str(value).lower() in {"false", "0", "no", "off"}:
                return False
            raise ValueError
        if isinstance(value, bool):  # YAML reads on/off/yes/no/true/false as booleans
            if base is str and name in ON_OFF_FIELDS:
                return "on" if value else "off"
            raise TunebenchError(f"config key '{key}' got the boolean {value!r}, which is not {TYPE_WORDS[base]}"
                                 + ("; quote it ('yes', 'on') if you meant the text" if base is str
                                    else "; give a number"))
        if base is int:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
                raise ValueError
            if abs(number) > 2**62:
                raise OverflowError
            return int(number)
        if base is float:
            number = float(value)
            if not math.isfinite(number):
                raise TunebenchError(f"config key '{key}' got {value!r}; it must be a finite number")
            return number
        if base is str:
            return value if isinstance(value, str) else str(value)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        return value
    raise TunebenchError(f"config key '{key}' got {_short(value)}, which is not {TYPE_WORDS.get(base, base.__name__)}; "
                         "fix the value")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_source(text: str) -> tuple[str, float | None]:
    """'support.csv:0.7' -> ('support.csv', 0.7); a path whose last ':' is not followed by a number keeps it."""
    path, sep, tail = str(text).rpartition(":")
    try:
        return (path, float(tail)) if sep and path else (str(text), None)
    except ValueError:
        return str(text), None


def _sources(value: Any) -> tuple[tuple[str, float], ...]:
    """data.sources as YAML ([{path, weight}], [[path, weight]]) or the command line (['a.csv:0.7', ...])."""
    if value in (None, "", [], ()):
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, dict) and set(item) <= {"path", "weight"} and "path" in item:
            path, weight = str(item["path"]), item.get("weight", 1.0)
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            path, weight = str(item[0]), item[1]
        elif isinstance(item, str):
            path, weight = parse_source(item)
            weight = 1.0 if weight is None else weight
        else:
            raise TunebenchError(f"data.sources entry {_short(item)} is not a path with a weight; give "
                                 "{path: FILE, weight: 0.7} in YAML or --data FILE:0.7")
        if isinstance(weight, bool) or not isinstance(weight, (int, float, str)):
            raise TunebenchError(f"data.sources weight of '{path}' must be a number, got {_short(weight)}")
        try:
            weight = float(weight)
        except ValueError:
            raise TunebenchError(f"data.sources weight of '{path}' must be a number, got {weight!r}") from None
        if not (math.isfinite(weight) and weight > 0) or not path:
            raise TunebenchError(f"data.sources needs a path and a weight above 0 for each dataset, got "
                                 f"'{path}' with {weight}")
        out.append((path, weight))
    if len({p for p, _ in out}) != len(out):
        raise TunebenchError("data.sources names a dataset twice; give each once, with its weight")
    return tuple(out)


def check_types(cfg: Any, sections: dict[str, type]) -> None:
    """Each field of a config built in Python (the API) holds its declared type and a finite number:
    what `_coerce` guarantees for YAML and the command line."""
    for section in sections:
        part = getattr(cfg, section)
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if _coerce(f"{section}.{f.name}", value, type(part)) != value:
                raise TunebenchError(f"config key '{section}.{f.name}' holds {_short(value)} as "
                                     f"{type(value).__name__}; give {_coerce(f'{section}.{f.name}', value, type(part))!r}")


def _set(tree: dict[str, dict[str, Any]], key: str, value: Any) -> None:
    key = KEY_ALIASES.get(key, key)
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _SECTION_TYPES or parts[1] not in {
        f.name for f in dataclasses.fields(_SECTION_TYPES[parts[0]])
    }:
        raise TunebenchError(f"unknown config key '{key}'{_nearest(key)}")
    if key == "train.micro_batch_size":
        auto = str(value).lower() == "auto"
        tree["train"]["autotune_batch"] = auto  # a given size is used as given
        if auto:
            return
    tree[parts[0]][parts[1]] = _coerce(key, value)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader without aliases to lists or mappings: five nested ones grow a few lines into
    megabytes (a "billion laughs" file); an alias to a plain value stays allowed."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if isinstance(self.anchors.get(event.anchor), (yaml.MappingNode, yaml.SequenceNode)):
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} repeats a list or mapping, "
                                                  "which tunebench does not expand", event.start_mark)
        return super().compose_node(parent, index)


def load_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise TunebenchError(f"config file '{p}' not found; check the path")
    try:
        loaded = load_yaml_text(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TunebenchError(f"config file '{p}' is not valid YAML ({first}); fix the syntax") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise TunebenchError(f"config file '{p}' must hold a mapping of sections (model, data, adapter, train)")
    return loaded


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not prefix:
            out.update(_flatten(v, key + "."))
        elif not prefix and k not in _SECTION_TYPES:
            raise TunebenchError(f"unknown config key '{k}'{_nearest(k)}")
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise TunebenchError(f"override '{text}' must look like section.key=value, e.g. train.lr=1e-4")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), load_yaml_text(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise TunebenchError(f"override '{text}' has a value that is not valid YAML; quote it") from e


PROFILES_DIR = Path(__file__).parent / "configs" / "profiles"


def shipped_yaml(spec: str, directory: Path, what: str) -> Path:
    """A YAML file, or the name of one shipped in `directory` (a matrix, a search space)."""
    path = Path(spec) if spec.endswith((".yaml", ".yml")) else directory / f"{spec}.yaml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise TunebenchError(f"{what} '{spec}' not found; pass a YAML file or one of: {shipped}")
    return path


def profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


# The performance guide's hardware profiles (configs/hardware/*.yaml, chosen with `hardware=gpu_4090`), by
# the memory class of tunebench's own.
PROFILE_ALIASES = {"gpu_4090": "gpu-24gb", "gpu_3090": "gpu-24gb", "gpu_low_mem": "gpu-8-12gb", "gpu_a100": "gpu-80gb",
                   "gpu_h100": "gpu-80gb"}


def profile_path(name: str) -> Path:
    name = PROFILE_ALIASES.get(name, name)
    path = Path(name) if name.endswith((".yaml", ".yml")) else PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TunebenchError(f"unknown --profile '{name}'; shipped profiles: {', '.join(profiles())} (and the guide's "
                             f"{', '.join(PROFILE_ALIASES)})")
    return path


def load_config(
    yaml_path: str | Path | None = None,
    options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    profile: str | None = None,
    world_size: int | None = None,
) -> RunConfig:
    """Defaults < hardware profile < YAML < options (dotted keys) < dotted overrides; then validate, at the
    number of processes the run will have (`world_size`; default torchrun's WORLD_SIZE, else 1)."""
    tree: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_TYPES}
    layers: list[dict[str, Any]] = []
    if profile is not None:
        layers.append(_flatten(read_yaml(profile_path(profile))))
    if yaml_path is not None:
        layers.append(_flatten(read_yaml(yaml_path)))
    layers.append(dict(options or {}))
    layers.append(dict(parse_override(o) for o in overrides or []))
    for layer in layers:
        for key, value in layer.items():
            _set(tree, key, value)
    adapter, train = tree["adapter"], tree["train"]
    if adapter.get("method") in OBJECTIVES[1:]:  # `--method dpo`: the objective, on the default adapter
        if train.get("objective", "sft") not in ("sft", adapter["method"]):
            raise TunebenchError(f"--method {adapter['method']} and --objective {train['objective']} disagree; give "
                                 "one of them (--objective dpo|orpo with --method lora|qlora|full|...)")
        train["objective"] = adapter.pop("method")
    objective = train.get("objective", "sft")
    for key, owner in (("beta", "dpo"), ("orpo_lambda", "orpo")):
        # TRL calls ORPO's lambda beta: a value set for another objective must not vanish unused. (A saved
        # config.yaml holds every key at its default, and reloads.)
        if train.get(key, getattr(TrainConfig, key)) != getattr(TrainConfig, key) and objective != owner:
            raise TunebenchError(f"--{key.replace('_', '-')} is {owner.upper()}'s, and this run's objective is "
                                 f"{objective}; " + ("ORPO's weight is --orpo-lambda" if key == "beta" and
                                                      objective == "orpo" else f"drop it or use --method {owner}"))
    if objective != "sft":
        adapter.setdefault("lora_dropout", 0.0)  # see preference.disable_dropout; asked for, it is kept
    if adapter.get("quantization", "none") != "none" and adapter.get("method", "lora") == "lora":
        adapter["method"] = "qlora"  # LoRA on a quantized base is QLoRA (the study's --use_4bit)
    cfg = RunConfig(**{s: cls(**tree[s]) for s, cls in _SECTION_TYPES.items()})
    validate(cfg, world_size)
    return cfg


def replace(cfg: RunConfig, **dotted: Any) -> RunConfig:
    """A copy of `cfg` with dotted keys replaced (`replace(cfg, **{"train.lr": 1e-3})`)."""
    tree = {s: dict(dataclasses.asdict(getattr(cfg, s))) for s in _SECTION_TYPES}
    for key, value in dotted.items():
        _set(tree, key, value)
    new = RunConfig(**{s: cls(**tree[s]) for s, cls in _SECTION_TYPES.items()})
    validate(new)
    return new


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TunebenchError(f"{key} '{value}' is not one of {', '.join(allowed)}; pick one of those")


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    check_types(cfg, _SECTION_TYPES)
    d, a, t = cfg.data, cfg.adapter, cfg.train
    if d.sources and d.path != BUILTIN_DATA:
        raise TunebenchError(f"data.path '{d.path}' and data.sources both name the data; give the mixture only "
                             "(--data FILE:WEIGHT once per dataset)")
    _choice("data.format", d.format, ("auto", "instruction", "alpaca", "question", "chat", "text"))
    _choice("data.train_on", d.train_on, ("response", "all"))
    _choice("data.packing", d.packing, ("auto", "on", "off"))
    _choice("adapter.method", a.method, METHODS)
    _choice("train.objective", t.objective, OBJECTIVES)
    _choice("adapter.quantization", a.quantization, ("none", "4bit", "8bit"))
    _choice("train.precision", t.precision, ("auto", "fp32", "bf16", "fp16"))
    _choice("train.device", t.device, ("auto", "cpu", "cuda", "mps"))
    _choice("train.schedule", t.schedule, SCHEDULES)
    _choice("train.report_to", t.report_to, ("none", "tensorboard"))
    _choice("train.compile", t.compile, ("auto", "on", "off"))
    _choice("train.compile_mode", t.compile_mode, ("default", "reduce-overhead", "max-autotune"))
    _choice("train.parallel", t.parallel, ("auto", "ddp", "fsdp"))
    _choice("train.backend", t.backend, ("auto", "gloo", "nccl"))
    _choice("train.attention", t.attention, ("auto", "sdpa", "eager", "tunebench", "flash_attention_2"))
    _choice("train.liger", t.liger, ("auto", "on", "off"))
    _choice("train.gradient_checkpointing", t.gradient_checkpointing, ("auto", "on", "off"))
    _choice("train.lr_scaling", t.lr_scaling, ("none", "linear", "sqrt"))
    positive = {
        "data.max_length (--max-length)": d.max_length,
        "train.micro_batch_size (--batch-size)": t.micro_batch_size,
            "adapter.r (--lora-r)": a.r,
        "train.save_total_limit": t.save_total_limit,
    }
    if t.logging_steps is not None:
        positive["train.logging_steps (--logging-steps)"] = t.logging_steps
    if t.max_steps is not None and t.max_tokens is not None:
        raise TunebenchError("--max-steps and --max-tokens both set the run's length; give one of them")
    if t.eval_generate < 0:
        raise TunebenchError(f"train.eval_generate (--eval-generate) must be 0 or more, got {t.eval_generate}")
    positive["train.eval_max_new_tokens (--eval-max-new-tokens)"] = t.eval_max_new_tokens
    if t.effective_batch_size is not None:
        positive["train.effective_batch_size (--effective-batch-size)"] = t.effective_batch_size
    for opt in ("grad_accum_steps", "max_steps", "max_tokens", "eval_steps", "save_steps", "threads"):
        if getattr(t, opt) is not None:
            positive[f"train.{opt}"] = getattr(t, opt)
    if d.max_samples is not None:
        positive["data.max_samples (--max-samples)"] = d.max_samples
    for name, value in positive.items():
        if value <= 0:
            raise TunebenchError(f"{name} must be a positive number, got {value}; pass a value of 1 or more")
    if t.epochs <= 0:
        raise TunebenchError(f"train.epochs must be positive, got {t.epochs}; pass --epochs 1 or more")
    if t.lr <= 0:
        raise TunebenchError(f"train.lr must be positive, got {t.lr}; pass e.g. --lr 2e-4")
    if not 0 <= t.warmup_ratio <= 1:
        raise TunebenchError(f"train.warmup_ratio must be in [0, 1], got {t.warmup_ratio}; pass e.g. --warmup-ratio 0.03")
    if t.weight_decay < 0:
        raise TunebenchError(f"train.weight_decay must be 0 or more, got {t.weight_decay}")
    if t.max_grad_norm <= 0:
        raise TunebenchError(f"train.max_grad_norm must be positive, got {t.max_grad_norm}; pass e.g. 1.0")
    if t.lr_reference_batch <= 0:
        raise TunebenchError(f"train.lr_reference_batch must be 1 or more, got {t.lr_reference_batch}")
    check_threads(t.threads, "--threads")
    if not 0 <= a.lora_dropout < 1:
        raise TunebenchError(f"adapter.lora_dropout must be in [0, 1), got {a.lora_dropout}")
    if not 0 <= d.eval_fraction < 1:
        raise TunebenchError(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    if a.method == "full" and a.quantization != "none":
        raise TunebenchError(
            f"--quantization {a.quantization} needs a frozen base; use --method qlora (or lora), not full"
        )
    if a.method == "qlora" and a.quantization == "none":
        raise TunebenchError("--method qlora needs --quantization 4bit or 8bit")
    if a.quantization != "none" and a.method not in ("lora", "qlora"):
        raise TunebenchError(f"--quantization {a.quantization} is QLoRA's: use --method qlora, or --quantization none "
                             f"with --method {a.method}")
    if a.num_virtual_tokens <= 0:
        raise TunebenchError(f"adapter.num_virtual_tokens must be 1 or more, got {a.num_virtual_tokens}")
    if t.objective != "sft":
        if t.beta <= 0 or t.orpo_lambda <= 0:
            raise TunebenchError(f"--beta and --orpo-lambda must be positive, got {t.beta} and {t.orpo_lambda}; "
                                 "the papers' default is 0.1")
        if d.packing == "on":
            raise TunebenchError(f"--objective {t.objective} keeps each pair's two rows side by side and cannot pack "
                                 "rows; use --packing auto or off")
        if (world_size or launched_world_size()) > 1:
            raise TunebenchError(f"--objective {t.objective} runs in one process for now; train without torchrun "
                                 "(tunebench launch)")
    if a.method in ("prefix", "prompt") and d.packing == "on":
        raise TunebenchError(f"--method {a.method} cannot train on packed rows (PEFT drops the position ids that "
                             "separate them); use --packing auto or off")
    cfg.batch_ask().check(world_size or launched_world_size())  # the job checks again once its group is up


def check_threads(threads: int | None, flag: str) -> None:
    """More threads than the CPUs this process may use only makes them take turns: refused."""
    if threads is None or not hasattr(os, "sched_getaffinity"):
        return
    allowed = len(os.sched_getaffinity(0))
    if threads > allowed:
        raise TunebenchError(f"{flag} {threads} is more than the {allowed} CPUs this process may use; pass "
                             f"{flag} {allowed} or less (or leave it unset to use the physical cores)")


def dump_yaml(cfg: RunConfig, path: str | Path) -> None:
    from tunebench.durable import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
