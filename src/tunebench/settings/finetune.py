"""Fine-tuning's configuration: its own `model`, `data`, `adapter` and `objective` sections beside the eight sections
every run shares (schema.py, which also holds how a load fills them). Cross-field rules are checked once,
in `validate`.
"""

from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tunebench.core.batch_rule import launched_world_size
from tunebench.core.errors import TunebenchError
from tunebench.settings import objectives, schema
from tunebench.settings.schema import short
from tunebench.settings.yamlfiles import parse_override, read_yaml

DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_PRESETS = ("tiny", "gpt2-124m", DEFAULT_MODEL)  # names model.name takes before any path (models.resolve)
BUILTIN_DATA = "builtin:customer-support"
METHODS = ("lora", "qlora", "dora", "ia3", "loha", "lokr", "prefix", "prompt", "full")
OBJECTIVES = objectives.NAMES  # each objective's own settings type: settings/objectives.py
FORMATS = ("auto", "instruction", "alpaca", "question", "chat", "xlam", "text")  # data/formats.py reads each
TRAIN_ON = ("response", "final", "all")
ON_UNRENDERABLE = ("refuse", "drop")
QUANTIZATIONS = ("none", "4bit", "8bit")


@dataclass(frozen=True)
class ModelConfig:
    name: str = DEFAULT_MODEL
    """a preset (smollm2-135m-instruct, gpt2-124m, tiny), a hub id in the HF cache, a HF directory or a .gguf file"""
    tokenizer: str | None = None
    """a tokenizer directory or id, when not the model's own"""
    allow_download: bool = False
    """let transformers fetch an uncached hub model (tunebench never reaches the hub unless asked)"""


@dataclass(frozen=True)
class DataConfig:
    path: str = BUILTIN_DATA
    """CSV, JSON, JSONL, Parquet or a saved datasets directory (the built-in customer-support sample by default);
    several --data FILE:WEIGHT train on a mixture"""
    format: str = "auto"
    """auto (from the columns) | instruction | alpaca | question (question + answer, GSM8K) | chat | xlam | text"""
    instruction_column: str = "instruction"
    """the prompt column of instruction data"""
    input_column: str = "input"
    """the extra input column of instruction data, appended to the prompt"""
    response_column: str = "response"
    """the answer column of instruction data"""
    messages_column: str = "messages"
    """the turns column of chat data"""
    text_column: str = "text"
    """the column of plain-text data"""
    template: str = "auto"
    """auto (the tokenizer's chat template if any) or a prompt such as '### Q:\\n{instruction}\\n### A:\\n'"""
    train_on: str = "response"
    """response (the loss on every assistant turn, its tool calls included) | final (on the last assistant turn
    only) | all (every token; tool results and definitions stay unlearned only under response and final)"""
    train_reasoning: bool = True
    """the loss on an assistant turn's reasoning (<think>...</think>) as well; false masks the trace"""
    on_unrenderable: str = "refuse"
    """refuse | drop: a chat row whose tools, calls, results or reasoning the chat template would not render"""
    max_length: int | None = 128
    """truncate examples to this many tokens; auto (None, `tunebench train`'s default): the length that keeps 99 in
    100 rows whole, rounded up to 64, within the model's positions"""
    packing: str = "auto"
    """auto (packed or length-grouped rows, whichever leaves the least padding) | on | off (off may still group
    rows by length)"""
    max_samples: int | None = None
    """use a seeded random subset of this many rows"""
    eval_fraction: float = 0.05
    """the share of rows held out for the eval loss"""
    eval_samples: int | None = None
    """a cap on the eval rows (after the split)"""
    # several datasets in one run: ((path, mixture weight), ...); each is formatted and split on its own,
    # and training draws from them in proportion to the weights. Empty: `path` alone.
    sources: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class AdapterConfig:
    """What trains: the method (a PEFT method, or full) and its own settings."""

    method: str = "lora"
    """the fine-tuning method (all but full are PEFT methods), or an objective, which then trains with LoRA (QLoRA
    with --quantization)"""
    r: int = 8
    """the rank of lora, qlora, dora, loha, lokr"""
    lora_alpha: int = 16
    """the scaling alpha of lora, qlora, dora, loha, lokr"""
    lora_dropout: float = 0.1
    """LoRA's dropout (lora, qlora, dora)"""
    target_modules: str = "auto"
    """auto (the attention projections) | all-linear | comma-separated module names (the weight methods)"""
    quantization: str = "none"
    """none | 4bit (nf4, QLoRA) | 8bit"""
    num_virtual_tokens: int = 20
    """the virtual tokens of prefix and prompt tuning"""
    prompt_init_text: str | None = None
    """prompt tuning: start the virtual tokens from this text's embeddings (default: random)"""


ObjectiveKeys = objectives.flat_section()  # the objective section as users spell it, made from the objectives' types


@dataclass(frozen=True)
class RunConfig(schema.RunBase):
    """A fine-tuning run's whole configuration: the shared sections, then its model, data and adapter; the
    effective batch schema.DEFAULT_EFFECTIVE_BATCH unless the batch keys say otherwise."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    adapter: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)
    objective: objectives.Objective = dataclasses.field(default_factory=objectives.SFT)

    default_effective: ClassVar[int | None] = schema.DEFAULT_EFFECTIVE_BATCH

    def to_dict(self) -> dict[str, Any]:
        d = SCHEMA.to_dict(self)
        d["data"]["sources"] = [{"path": p, "weight": w} for p, w in self.data.sources]  # YAML has no tuples
        return d

SECTIONS = {"model": ModelConfig, "data": DataConfig, "adapter": AdapterConfig, "objective": ObjectiveKeys,
            **schema.SHARED}
# The objective's keys as they were spelled inside the adapter section (adapter.objective, adapter.beta, ...), and
# a top-level `objective: dpo` in YAML: still read, as the objective section's.
AS_ADAPTER = {"adapter.objective": "objective.name", "objective": "objective.name",
              **{f"adapter.{f.name}": f"objective.{f.name}" for f in dataclasses.fields(ObjectiveKeys)
                 if f.name != "name"}}

# Names other tools use for our keys, so the hint lands on the right one.
SYNONYMS = {"max_seq_length": "max_length", "lora_r": "r", "rank": "r", "alpha": "lora_alpha",
            "dropout": "lora_dropout", "model_name": "name", "dataset": "path", "lora": "adapter",
            "dataset_path": "path"}

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
            raise TunebenchError(f"data.sources entry {short(item)} is not a path with a weight; give "
                                 "{path: FILE, weight: 0.7} in YAML or --data FILE:0.7")
        if isinstance(weight, bool) or not isinstance(weight, (int, float, str)):
            raise TunebenchError(f"data.sources weight of '{path}' must be a number, got {short(weight)}")
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


PROFILES_DIR = Path(__file__).parents[1] / "configs" / "profiles"


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




SCHEMA = schema.Schema(
    "train", SECTIONS, defaults={"data.max_length": None},  # auto: settled from the rows (finetune_data.settle_length)
    # the hardware guide's Hydra key; the rest of its keys are the flat sections' (schema.FLAT_SECTIONS)
    aliases={"model.use_gradient_checkpointing": "hardware.gradient_checkpointing", **AS_ADAPTER},
    hints=SYNONYMS, choices={
        "data.format": FORMATS, "data.train_on": TRAIN_ON, "data.on_unrenderable": ON_UNRENDERABLE,
        "data.packing": schema.ON_OFF, "adapter.method": METHODS, "objective.name": OBJECTIVES,
        "adapter.quantization": QUANTIZATIONS, "objective.loss_type": objectives.LOSS_TYPES,
        "objective.scale_rewards": objectives.SCALE_REWARDS, "objective.turn_credit": objectives.TURN_CREDITS},
    builders={"objective": objectives.build},
    converters={"data.sources": _sources, "data.packing": lambda value: (
        "on" if value else "off") if isinstance(value, bool) else schema.coerce_value("data.packing", value, str),
        "objective.reward": lambda value: _items("objective.reward", value, str),
        "objective.reward_weights": lambda value: _items("objective.reward_weights", value, float)})


def _items(key: str, value: Any, kind: type) -> tuple:
    """A list setting (GRPO's rewards and their weights): YAML's list, or the command line's items, each a `kind`."""
    if value in (None, "", [], ()):
        return ()
    return tuple(schema.coerce_value(key, v, kind) for v in (value if isinstance(value, (list, tuple)) else [value]))


def all_keys() -> list[str]:
    return SCHEMA.keys()


def load_config(
    yaml_path: str | Path | None = None,
    options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    profile: str | None = None,
    world_size: int | None = None,
) -> RunConfig:
    """Defaults < hardware profile < YAML < options (dotted keys) < dotted overrides; then validate, at the
    number of processes the run will have (`world_size`; default torchrun's WORLD_SIZE, else 1)."""
    layers: list[dict[str, Any]] = []
    if profile is not None:
        layers.append(SCHEMA.flatten(read_yaml(profile_path(profile)), f"profile {profile}"))
    if yaml_path is not None:
        layers.append(SCHEMA.flatten(read_yaml(yaml_path), str(yaml_path)))
    layers.append(dict(options or {}))
    layers.append(dict(parse_override(o) for o in overrides or []))
    tree = SCHEMA.fill(layers)
    adapter, given = tree["adapter"], tree["objective"]
    if adapter.get("method") in OBJECTIVES[1:]:  # `--method dpo`: the objective, on the default adapter
        if given.get("name", "sft") not in ("sft", adapter["method"]):
            raise TunebenchError(f"--method {adapter['method']} and --objective {given['name']} disagree; give "
                                 "one of them (--objective dpo|orpo with --method lora|qlora|full|...)")
        given["name"] = adapter.pop("method")
    objective = given.get("name", "sft")
    if objective != "sft":
        adapter.setdefault("lora_dropout", 0.0)  # see preference.disable_dropout; asked for, it is kept
    if adapter.get("quantization", "none") != "none" and adapter.get("method", "lora") == "lora":
        adapter["method"] = "qlora"  # LoRA on a quantized base is QLoRA (the study's --use_4bit)
    cfg = RunConfig(**SCHEMA.build(tree))
    validate(cfg, world_size)
    return cfg


def replace(cfg: RunConfig, **dotted: Any) -> RunConfig:
    """A copy of `cfg` with dotted keys replaced (`replace(cfg, **{"optimizer.lr": 1e-3})`)."""
    tree = {s: dict(dataclasses.asdict(getattr(cfg, s))) for s in SECTIONS}  # the objective's: its name and own keys
    for key, value in dotted.items():
        for resolved, v in SCHEMA.resolve(key, value):
            section, name = resolved.split(".")
            tree[section][name] = v
    new = RunConfig(**SCHEMA.build(tree))
    validate(new)
    return new


def not_sharded(cfg: RunConfig) -> str | None:
    """Why this run cannot train under FSDP (None: it can): GRPO's ranks and --eval-generate decode with a whole
    model on each rank, each stopping at its own EOS, so a sharded forward's gathers would not line up."""
    if cfg.objective.samples:
        return ("--objective grpo samples its completions from a whole model on each rank, and FSDP shards it; use "
                "--parallel ddp (LoRA, or a full fine-tune that fits on one rank)")
    if cfg.evaluation.eval_generate:
        return ("--eval-generate needs the whole model on one rank, and FSDP shards it; run `tunebench eval "
                "--adapter OUT --generate N` after training instead")
    return None


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    SCHEMA.check(cfg)
    world_size = world_size or launched_world_size()
    schema.check_shared(cfg, world_size, "train")
    d, a, o, e = cfg.data, cfg.adapter, cfg.objective, cfg.evaluation
    check_template(d.template)
    if d.sources and d.path != BUILTIN_DATA:
        raise TunebenchError(f"data.path '{d.path}' and data.sources both name the data; give the mixture only "
                             "(--data FILE:WEIGHT once per dataset)")
    for name, value in (("data.max_length (--max-length)", d.max_length), ("adapter.r (--lora-r)", a.r),
                        ("adapter.num_virtual_tokens", a.num_virtual_tokens),
                        ("data.max_samples (--max-samples)", d.max_samples)):
        if value is not None and value <= 0:
            raise TunebenchError(f"{name} must be a positive number, got {value}; pass a value of 1 or more")
    if not 0 <= a.lora_dropout < 1:
        raise TunebenchError(f"adapter.lora_dropout must be in [0, 1), got {a.lora_dropout}")
    if not 0 <= d.eval_fraction < 1:
        raise TunebenchError(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    for key, value in (("evaluation.sample_prompt", e.sample_prompt), ("evaluation.sample_tokens", e.sample_tokens)):
        if value is not None:
            raise TunebenchError(f"{key} is pretraining's (samples at each evaluation); fine-tuning scores its "
                                 "answers with --eval-generate N instead")
    if a.method == "full" and a.quantization != "none":
        raise TunebenchError(
            f"--quantization {a.quantization} needs a frozen base; use --method qlora (or lora), not full"
        )
    if a.method == "qlora" and a.quantization == "none":
        raise TunebenchError("--method qlora needs --quantization 4bit or 8bit")
    if a.quantization != "none" and a.method not in ("lora", "qlora"):
        raise TunebenchError(f"--quantization {a.quantization} is QLoRA's: use --method qlora, or --quantization none "
                             f"with --method {a.method}")
    o.check()
    if o.samples and e.eval_generate:
        raise TunebenchError("--eval-generate scores answers against held-out replies, and GRPO's prompts have none: a "
                             "GRPO run reports its held-out reward instead (--eval-fraction); drop --eval-generate")
    if o.data != "rows" and d.packing == "on":
        raise TunebenchError(f"--objective {o.name} keeps each pair's two rows side by side and cannot pack rows; use "
                             "--packing auto or off")
    if a.method in ("prefix", "prompt") and d.packing == "on":
        raise TunebenchError(f"--method {a.method} cannot train on packed rows (PEFT drops the position ids that "
                             "separate them); use --packing auto or off")
    if world_size > 1 and cfg.distributed.parallel == "fsdp" and (refused := not_sharded(cfg)):
        raise TunebenchError(refused)
    cfg.batch_ask().check(world_size)  # the job checks again once its group is up


def check_template(template: str) -> None:
    """A prompt format holds {instruction}, as is: no other field, no conversion and no format spec (a
    `{instruction:>999999999}` would allocate a gigabyte for every prompt rendered)."""
    if template in ("auto", "chat"):
        return

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise TunebenchError(f"data.template {short(template)} is not a prompt format ({e}); write literal braces "
                             "as {{ and }}") from None
    for name, spec, conv in fields:
        if name != "instruction" or spec or conv:
            raise TunebenchError(f"data.template {short(template)} has the field {{{name}{'!' + conv if conv else ''}"
                                 f"{':' + spec if spec else ''}}}; a prompt format holds {{instruction}} alone, as is")


