"""The run schema both training jobs share, and the loader that fills it.

A run's configuration is sections, each a typed, frozen dataclass. `train` and `pretrain` share eight of
them, defined here once: hardware, batch, optimizer, schedule, output, evaluation, logging, distributed.
Each job adds its own `model` and `data` (settings/finetune.py, settings/pretrain.py; fine-tuning also
`adapter`).
The string under each field is its documentation and the command line's help for it.

Values arrive in layers, lowest first: the job's defaults, a hardware profile, the YAML file, command-line
options, dotted overrides (`optimizer.lr=1e-4`). Other documents' spellings are translated at load
(`ALIASES`, `FIELD_ALIASES`): the flat `train:` / `training:` sections (`train.lr`, `training.batch_size`),
the CPU guide's `learning_rate`, `num_epochs`, `checkpoint_dir`, `use_amp`, the hardware guide's
`optimization.compile`. Two spellings of one key in one layer must agree. Unknown keys are errors naming
the nearest valid key; a value of the wrong type is refused at load, with the fix.

Whether a value was given is what it holds: a setting whose default depends on the run (the batch split,
DPO's beta) defaults to None, never to a value that a given one could equal.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from tunebench.core.batch_rule import BatchAsk, asked
from tunebench.core.errors import TunebenchError
from tunebench.settings import tracking

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "amp")
ON_OFF = ("auto", "on", "off")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
MEASURE_MODES = ("bounded", "full")  # tunebench.training.autotune.budget
ATTENTIONS = ("auto", "sdpa", "eager", "tunebench", "flash_attention_2")
SCHEDULES = ("cosine", "linear", "constant", "warmup_stable_decay")  # transformers.get_scheduler's (optim.lr_factor)
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused")  # HF's names; all are torch's AdamW (fused where it helps)
LR_SCALING = ("none", "linear", "sqrt")
PARALLELS = ("auto", "ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")
EXPORT_FORMATS = ("gguf", "ollama", "hf")  # tunebench export --format (jobs/export.py), the studio's export
DEFAULT_EFFECTIVE_BATCH = 8  # rows per optimizer step when no batch key says otherwise (the study's 8)


@dataclass(frozen=True)
class HardwareConfig:
    device: str = "auto"
    """where to train: auto (CUDA, then MPS, then the CPU) | cpu | cuda | mps"""
    force_cpu: bool = False
    """train on the CPU whatever `device` says (the CPU guide's switch)"""
    precision: str = "auto"
    """auto (the fastest the hardware computes natively) | fp32 | bf16 | fp16 | amp (16-bit where the hardware
    has it, refused where it has none)"""
    threads: int | None = None
    """torch's CPU threads (default: OMP_NUM_THREADS, else one per physical core this process may use)"""
    compile: str = "auto"
    """torch.compile: auto (when measured faster) | on | off"""
    compile_mode: str = "default"
    """torch.compile's mode: default | reduce-overhead | max-autotune"""
    attention: str = "auto"
    """attention kernel: auto (the fastest measured) | sdpa | eager | tunebench | flash_attention_2 (CUDA)"""
    measure: str = "bounded"
    """how much the auto settings may measure before training: bounded (at most a tenth of the training they decide,
    20 s at least; a candidate that would not fit in that is not measured, and its row says so) | full (every
    attention kernel and micro batch)"""
    gradient_checkpointing: str = "auto"
    """recompute activations in the backward pass: auto (only when the batch would not fit otherwise) | on | off"""
    liger: str = "auto"
    """Liger kernels: auto (on a CUDA GPU when liger-kernel is installed and knows the model) | on | off"""
    dataloader_num_workers: int = 0
    """accepted from HF and the CPU guide: batches are slices of tokenized data in memory, no workers needed"""
    dataloader_pin_memory: bool = True
    """pin host memory for copies to a GPU (when the hardware plan pins at all)"""
    dataloader_prefetch_factor: int | None = None
    """accepted from the CPU guide: there is nothing to prefetch"""


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int | None = None
    """rows per forward pass, or auto (the default, held as None): measure the sizes that divide the effective
    batch and keep the fastest"""
    grad_accum_steps: int | None = None
    """micro batches per optimizer step (default: effective batch / (micro batch x processes))"""
    effective_batch_size: int | None = None
    """rows per optimizer step over all processes (default 8, or micro x accumulation x processes when both
    of those are given)"""


@dataclass(frozen=True)
class Optimizer:
    lr: float = 2e-4
    """peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    adam_beta1: float = 0.9
    """AdamW's beta1"""
    adam_beta2: float = 0.999
    """AdamW's beta2 (0.99 suits small models and batches: nanoGPT's character-level recipe)"""
    optimizer: str = "adamw"
    """adamw | adamw_torch | adamw_torch_fused (HF's names; all are torch's AdamW, fused where that is faster)"""
    lr_scaling: str = "none"
    """none | linear | sqrt: scale lr when the effective batch differs from lr_reference_batch"""
    lr_reference_batch: int = DEFAULT_EFFECTIVE_BATCH
    """the effective batch the lr was tuned at (for lr_scaling)"""


@dataclass(frozen=True)
class Schedule:
    epochs: float = 1.0
    """passes over the training data"""
    max_steps: int | None = None
    """stop after this many optimizer steps (instead of epochs)"""
    max_tokens: int | None = None
    """a token budget: the steps that train on about this many real tokens (instead of epochs)"""
    schedule: str = "cosine"
    """learning-rate schedule: cosine | linear | constant | warmup_stable_decay (transformers' formulas)"""
    warmup_ratio: float = 0.03
    """share of the steps for linear warm-up (used when warmup_steps is 0)"""
    warmup_steps: int = 0
    """steps of linear warm-up"""
    seed: int = 42
    """seed for initialisation, the split and the data order"""
    time_budget: str | None = None
    """train for about this long (90s, 30m, 2h): the steps are set from the measured speed, after measuring,
    never more than the epochs or max steps give; where steps sample (GRPO, RFT) the run ends after the step that
    passes it"""


def budget_seconds(text: str) -> float:
    """'90s', '30m', '1.5h' or a number of seconds, as seconds; refused with the form otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise TunebenchError(f"schedule.time_budget (--time-budget) {text!r} is not a length of time; write it as 90s, "
                             "30m or 2h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass(frozen=True)
class Output:
    output_dir: str = "runs/latest"
    """the run directory: weights, metrics, checkpoints, config.yaml and plan.json"""
    save_steps: int | None = None
    """checkpoint every N steps (default: at the end and on interrupt)"""
    save_total_limit: int = 2
    """keep the newest N checkpoints"""
    resume: str | None = None
    """auto (the newest checkpoint in output_dir) | a checkpoint directory"""
    overwrite: bool = False
    """replace an earlier run in output_dir (never implied)"""


@dataclass(frozen=True)
class Evaluation:
    eval_steps: float | None = None
    """eval loss every N steps, or below 1 a share of the steps (0.25: 4 evals; default: before and after)"""
    eval_generate: int = 0
    """train: at the end, answer N held-out rows and score them (ROUGE-L, chrF, exact match, EOS rate)"""
    eval_max_new_tokens: int = 128
    """train: the cap on each of those answers"""
    sample_prompt: str | None = None
    """pretrain: each evaluation samples a continuation of this text (default: the start of a validation block)"""
    sample_tokens: int | None = None
    """pretrain: tokens in each sample"""


@dataclass(frozen=True)
class Logging:
    logging_steps: int | None = None
    """write metrics every N steps (default: every step on a CPU, every 10 on a GPU: each read is a sync)"""
    report_to: str = "none"
    """experiment trackers, a list or comma-separated: tensorboard, mlflow, wandb, trackio (none: metrics.jsonl
    only). Each gets the settings with their reasons, every logged step, the summary and (MLflow, W&B, Trackio)
    the report and model"""
    project: str | None = None
    """the MLflow experiment, W&B project and Trackio project (default: tunebench; in compare and tune, theirs)"""
    run_name: str | None = None
    """the run's name in the trackers (default: the output directory's name)"""
    group: str | None = None
    """the W&B and Trackio group, an MLflow tag (compare and tune: their name)"""
    log_model: bool = True
    """send the trained adapter or model to the trackers that store files (MLflow, W&B, Trackio)"""
    logging_dir: str | None = None
    """where tensorboard writes (default: RUN_DIR/tensorboard)"""
    progress: bool = True
    """a progress bar"""
    monitor: bool = True
    """a background sampler of CPU, memory and GPU use"""


@dataclass(frozen=True)
class Distributed:
    parallel: str = "auto"
    """under torchrun / tunebench launch: auto (DDP; FSDP2 when full fine-tuning does not fit a rank) | ddp | fsdp"""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl"""
    world_size: int | None = None
    """the number of processes the run must be started with (checked: a config cannot start processes)"""


@dataclass(frozen=True)
class RunBase:
    """The eight sections every run shares, each defaulting to its section's defaults. A job's run type extends
    it with its own sections and its effective batch when no batch key gives one (settings.finetune.RunConfig:
    model, data, adapter, objective, DEFAULT_EFFECTIVE_BATCH; settings.pretrain.PretrainRun: model, data, the CPU
    guide's micro x accumulation)."""

    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    schedule: Schedule = dataclasses.field(default_factory=Schedule)
    output: Output = dataclasses.field(default_factory=Output)
    evaluation: Evaluation = dataclasses.field(default_factory=Evaluation)
    logging: Logging = dataclasses.field(default_factory=Logging)
    distributed: Distributed = dataclasses.field(default_factory=Distributed)

    default_effective: typing.ClassVar[int | None] = None

    def batch_ask(self) -> BatchAsk:
        """What the batch keys ask for (batch_rule.asked holds the rule)."""
        b = self.batch
        return asked(b.effective_batch_size, b.micro_batch_size, b.grad_accum_steps, self.default_effective)

    @property
    def effective_batch_size(self) -> int:
        """Rows per optimizer step in one process."""
        return self.batch_ask().effective_for(1)


SHARED: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunBase)}  # section -> its class
CHOICES: dict[str, tuple[str, ...]] = {
    "hardware.device": DEVICES, "hardware.precision": PRECISIONS, "hardware.compile": ON_OFF,
    "hardware.compile_mode": COMPILE_MODES, "hardware.attention": ATTENTIONS, "hardware.gradient_checkpointing": ON_OFF,
    "hardware.measure": MEASURE_MODES,
    "hardware.liger": ON_OFF, "optimizer.optimizer": OPTIMIZERS, "optimizer.lr_scaling": LR_SCALING,
    "schedule.schedule": SCHEDULES, "distributed.parallel": PARALLELS,
    "distributed.backend": BACKENDS}
ON_OFF_KEYS = {k for k, v in CHOICES.items() if v == ON_OFF}  # YAML's `true`/`false` reads as on/off there

# The flat sections other documents (and tunebench before its sections) use: `train.lr`, the CPU guide's
# `training.learning_rate`, the hardware guide's `optimization.compile`. Their keys are found in the shared
# sections by name, after FIELD_ALIASES.
FLAT_SECTIONS = ("train", "training", "optimization")
FIELD_ALIASES = {"batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
                 "learning_rate": "lr", "num_epochs": "epochs", "num_train_epochs": "epochs",
                 "gradient_accumulation_steps": "grad_accum_steps", "checkpoint_dir": "output_dir",
                 "lr_scheduler": "schedule", "lr_scheduler_type": "schedule", "distributed_backend": "backend"}


def precision_alias(name: str, value: Any) -> str | None:
    """The CPU guide's and HF's precision switches as a precision: use_amp true -> amp (16-bit where the
    hardware has it), false -> fp32; fp16/bf16 true -> that precision, false -> no request."""
    on = coerce_value(f"training.{name}", value, bool)
    if name == "use_amp":
        return "amp" if on else "fp32"
    return name if on else None


PRECISION_ALIASES = ("use_amp", "fp16", "bf16")
# batch.autotune_batch, the flag beside the micro batch before "auto" became None: config.yaml files of earlier runs
# and profiles still hold it, so it is read (true: auto, whatever size beside it), never written.
LEGACY_AUTOTUNE = "batch.autotune_batch"


@functools.cache
def docs(cls: type) -> dict[str, str]:
    """{field: the string literal under it} of a dataclass: its documentation and command-line help."""
    if "FIELD_DOCS" in vars(cls):  # a section made from other types' fields (settings.objectives.flat_section)
        return dict(cls.FIELD_DOCS)
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    out = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            out[node.target.id] = " ".join(str(after.value.value).split())
    return out


def help_for(key: str, sections: dict[str, type] = SHARED) -> str:
    section, name = key.split(".")
    return docs(sections[section]).get(name, "")


@dataclass(frozen=True)
class Schema:
    """One job's sections, its defaults and its own spellings, and how a layered load fills them."""

    job: str  # train | pretrain
    sections: dict[str, type]  # the job's model, data (and adapter) sections, then SHARED
    defaults: dict[str, Any]  # dotted keys whose default differs from the section's (the job's own)
    aliases: dict[str, str]  # the job's own dotted spellings -> a dotted key
    hints: dict[str, str]  # names other tools use, for 'did you mean' only
    converters: dict[str, Any] = dataclasses.field(default_factory=dict)  # key -> its own reader (data.sources)
    choices: dict[str, tuple] = dataclasses.field(default_factory=dict)  # the job's own keys' choices (CHOICES: shared)
    # a section a run holds as something other than its spelled keys (the objective: its own typed settings)
    builders: dict[str, Any] = dataclasses.field(default_factory=dict)

    def keys(self) -> list[str]:
        return [f"{s}.{f.name}" for s, cls in self.sections.items() for f in dataclasses.fields(cls)]

    def key_of(self, spelled: str) -> str | None:
        """The section.field a spelling names (other documents' spellings included), None if none."""
        key = self.aliases.get(spelled, spelled)
        if key.count(".") != 1:
            return None
        if key.endswith(".autotune_batch"):
            return LEGACY_AUTOTUNE
        section, name = key.split(".")
        if section in FLAT_SECTIONS and section not in self.sections:
            if name in PRECISION_ALIASES:
                return "hardware.precision"
            name = FIELD_ALIASES.get(name, name)
            section = next((s for s in self.sections if name in {f.name for f in dataclasses.fields(self.sections[s])}),
                           section)
            if section not in self.sections and "." in self.aliases.get(name, ""):  # train.objective: a top-level alias
                return self.key_of(self.aliases[name])
        if section not in self.sections or name not in {f.name for f in dataclasses.fields(self.sections[section])}:
            return None
        return f"{section}.{name}"

    def resolve(self, spelled: str, value: Any) -> list[tuple[str, Any]]:
        """The (section.field, value) pairs one given key sets, or an error naming the nearest valid key."""
        key = self.key_of(spelled)
        if key is None:
            raise TunebenchError(f"unknown config key '{spelled}'{self.nearest(spelled)}")
        if value is None and spelled in self.aliases:  # another section's switch left unset (model.gradient_checkpointing)
            return []
        name = spelled.rsplit(".", 1)[-1]
        if name in PRECISION_ALIASES and key == "hardware.precision":
            precision = precision_alias(name, value)
            return [] if precision is None else [(key, precision)]
        if key == "batch.micro_batch_size" and (value is None or str(value).lower() == "auto"):
            return [(key, None)]  # auto measures; a number is used as given
        if key == "data.max_length" and self.job == "train" and (value is None or str(value).lower() == "auto"):
            return [(key, None)]  # auto: the length that keeps the rows whole, settled when they are read
        if key == LEGACY_AUTOTUNE:  # config.yaml of earlier runs, older profiles: true meant auto
            return [(key, coerce_value(spelled, value, bool))]
        return [(key, self.coerce(key, value, spelled))]

    def coerce(self, key: str, value: Any, spelled: str | None = None) -> Any:
        """`value` as key's declared type; an error names the key as the user spelled it."""
        section, name = key.split(".")
        if key in self.converters:
            return self.converters[key](value)
        if key == "logging.report_to":
            return tracking.parse(value)
        if isinstance(value, bool) and key in ON_OFF_KEYS:
            return "on" if value else "off"
        return coerce_value(spelled or key, value, typing.get_type_hints(self.sections[section])[name])

    def nearest(self, key: str) -> str:
        return nearest_key(key, self.keys(), {**self.hints, **FIELD_ALIASES}, f"tunebench {self.job} --help")

    def fill(self, layers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """{section: {field: value}} from layers of dotted keys, lowest first; within one layer two spellings of
        one key must agree (`use_amp: true` beside `precision: fp32` is refused, not one of them dropped)."""
        tree: dict[str, dict[str, Any]] = {s: {} for s in self.sections}
        for layer in [dict(self.defaults), *layers]:
            for key, value in self.canonical(layer).items():
                section, name = key.split(".")
                tree[section][name] = value
        return tree

    def canonical(self, mapping: dict[str, Any]) -> dict[str, Any]:
        """`mapping`'s dotted keys in their one spelling (section.field), so that merging two mappings lets the
        later one win over the earlier whatever spelling each used (fill refuses two spellings in one layer)."""
        out: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for spelled, raw in mapping.items():
            for key, value in self.resolve(spelled, raw):
                if key in out and out[key] != value:
                    raise TunebenchError(f"'{seen[key]}' and '{spelled}' both set {key} ({out[key]!r} and {value!r}); "
                                         "give one of them")
                out[key], seen[key] = value, spelled
        if out.pop(LEGACY_AUTOTUNE, False):  # beside the size it was written with: auto won, as it did then
            out["batch.micro_batch_size"] = None
        return out

    def build(self, tree: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {s: self.builders[s](tree[s]) if s in self.builders else cls(**tree[s])
                for s, cls in self.sections.items()}

    def flatten(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """A YAML file's {section: {key: value}} as dotted keys; a top-level value that is not a section
        (the CPU guide's `device: cpu`) is `section.key` of `aliases`."""
        out: dict[str, Any] = {}
        for section, values in raw.items():
            if isinstance(values, dict):
                out.update({f"{section}.{k}": v for k, v in values.items()})
            elif section in self.aliases:
                out[section] = values
            else:
                raise TunebenchError(f"{source}: unknown config key '{section}'{self.nearest(str(section))}")
        return out

    def check(self, cfg: Any) -> None:
        """Every field holds its declared type (a config built in Python included), every choice is a known one."""
        for section in self.sections:
            part = getattr(cfg, section)
            for f in dataclasses.fields(part):
                key, value = f"{section}.{f.name}", getattr(part, f.name)
                fixed = self.coerce(key, value)
                if fixed != value:
                    raise TunebenchError(f"config key '{key}' holds {short(value)} as {type(value).__name__}; "
                                         f"give {fixed!r}")
                allowed = self.choices.get(key) or CHOICES.get(key)  # None: unset, where the type allows it
                if allowed is not None and value is not None and value not in allowed:
                    raise TunebenchError(f"{key} '{value}' is not one of {', '.join(map(str, allowed))}; pick one "
                                         "of those")

    def to_dict(self, cfg: Any) -> dict[str, Any]:
        """The configuration as plain data, shaped as JSON and YAML read it back (a tuple as a list), so that a
        run's identity compares equal to the one its checkpoint saved."""
        return {s: plain(dataclasses.asdict(getattr(cfg, s))) for s in self.sections}


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def check_shared(cfg: Any, world_size: int, job: str) -> None:
    """The shared sections' own rules (each job adds its own and checks its batch request)."""
    h, b, o, s, out, e, lg, dist = (getattr(cfg, name) for name in SHARED)
    positive = {"output.save_total_limit": out.save_total_limit, "optimizer.lr (--lr)": o.lr,
                "schedule.epochs (--epochs)": s.epochs, "optimizer.max_grad_norm": o.max_grad_norm,
                "optimizer.lr_reference_batch": o.lr_reference_batch,
                "evaluation.eval_max_new_tokens (--eval-max-new-tokens)": e.eval_max_new_tokens}
    if b.micro_batch_size is not None:
        positive["batch.micro_batch_size (--batch-size)"] = b.micro_batch_size
    for section, names in (("batch", ("grad_accum_steps", "effective_batch_size")),
                           ("schedule", ("max_steps", "max_tokens")), ("output", ("save_steps",)),
                           ("evaluation", ("eval_steps", "sample_tokens")), ("logging", ("logging_steps",)),
                           ("hardware", ("threads", "dataloader_prefetch_factor")), ("distributed", ("world_size",))):
        for name in names:
            if getattr(getattr(cfg, section), name) is not None:
                positive[f"{section}.{name}"] = getattr(getattr(cfg, section), name)
    for name, value in positive.items():
        if value <= 0:
            raise TunebenchError(f"{name} must be a positive number, got {value}; pass a value above 0")
    for name, value in (("optimizer.weight_decay", o.weight_decay), ("schedule.warmup_steps", s.warmup_steps),
                        ("evaluation.eval_generate (--eval-generate)", e.eval_generate),
                        ("hardware.dataloader_num_workers", h.dataloader_num_workers)):
        if value < 0:
            raise TunebenchError(f"{name} must be 0 or more, got {value}")
    for name, value in (("optimizer.adam_beta1", o.adam_beta1), ("optimizer.adam_beta2", o.adam_beta2)):
        if not 0 <= value < 1:
            raise TunebenchError(f"{name} must be in [0, 1), got {value}")
    if not 0 <= s.warmup_ratio <= 1:
        raise TunebenchError(f"schedule.warmup_ratio must be in [0, 1], got {s.warmup_ratio}; pass e.g. 0.03")
    if s.time_budget is not None:
        budget_seconds(s.time_budget)
    if s.max_steps is not None and s.max_tokens is not None:
        raise TunebenchError("--max-steps and --max-tokens both set the run's length; give one of them")
    check_threads(h.threads, "--threads")
    tracking.check(lg.report_to)
    if dist.world_size is not None and dist.world_size != world_size:
        raise TunebenchError(f"distributed.world_size is {dist.world_size}, and this run was started as {world_size} "
                             f"process(es); start {dist.world_size}: `tunebench launch --nproc-per-node "
                             f"{dist.world_size} -- {job} ...` on one machine (--nnodes x --nproc-per-node across "
                             "machines), or drop world_size")


def check_threads(threads: int | None, flag: str) -> None:
    """More threads than the CPUs this process may use only makes them take turns: refused."""
    if threads is None or not hasattr(os, "sched_getaffinity"):
        return
    allowed = len(os.sched_getaffinity(0))
    if threads > allowed:
        raise TunebenchError(f"{flag} {threads} is more than the {allowed} CPUs this process may use; pass "
                             f"{flag} {allowed} or less (or leave it unset to use the physical cores)")


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


TYPE_WORDS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def coerce_value(key: str, value: Any, hint: Any) -> Any:
    """`value` (from YAML or the command line) as the declared type `hint` of `key`, or an error naming the key.

    Strict on purpose: a value that only looks right (a list for a number, `true` for a step count,
    an infinite learning rate) is refused here, at load, with the fix, never carried into a run."""
    args = typing.get_args(hint)
    optional = type(None) in args or (isinstance(hint, types.UnionType) and type(None) in args)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    words = TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))
    if value is None or (isinstance(value, str) and value.lower() in {"none", "null"} and base is not str):
        if optional:
            return None
        raise TunebenchError(f"config key '{key}' cannot be empty; give it {words}")
    if isinstance(value, (list, tuple, dict, set)):
        raise TunebenchError(f"config key '{key}' takes one value ({words}), got a {type(value).__name__} "
                             f"({short(value)}); give a single value")
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
            raise TunebenchError(f"config key '{key}' got the boolean {value!r}, which is not {words}"
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
    raise TunebenchError(f"config key '{key}' got {short(value)}, which is not {words}; fix the value")


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

