"""The command line's shape: every job's options and what each means. cli.py turns what is parsed into a
config and runs the job."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

from tunebench.core import VERSION
from tunebench.core.errors import TunebenchError
from tunebench.interfaces import cli_jobs
from tunebench.settings import schema  # torch-free: the sections and their documentation
from tunebench.settings.finetune import METHODS, OBJECTIVES, SECTIONS, ObjectiveKeys, load_config, parse_source
from tunebench.settings.objectives import default_text
from tunebench.settings.rundir import RunDir


def objective_flags(section: type = ObjectiveKeys) -> list[tuple[tuple[str, ...], str]]:
    """A flag for every key of the objective section (settings.finetune.ObjectiveKeys, made from the objectives'
    types, whose fields' documentation is the help): --the-key, and the study's --the_key; its name is
    --objective."""
    return [(("--objective",), "objective.name"), *[
        (tuple(dict.fromkeys((f"--{f.name.replace('_', '-')}", f"--{f.name}"))), f"objective.{f.name}")
        for f in dataclasses.fields(section) if f.name != "name"]]


# (flags, config key): the help is the field's documentation in settings/finetune.py, with its default.
# The reference study's underscore spellings are aliases.
TRAIN_OPTIONS: list[tuple[tuple[str, ...], str]] = [
    (("--model", "--model_name"), "model.name"),
    (("--tokenizer",), "model.tokenizer"),
    (("--data", "--dataset"), "data.path"),
    (("--format",), "data.format"),
    (("--instruction-column",), "data.instruction_column"),
    (("--response-column",), "data.response_column"),
    (("--template",), "data.template"),
    (("--train-on",), "data.train_on"),
    (("--train-reasoning",), "data.train_reasoning"),
    (("--on-unrenderable",), "data.on_unrenderable"),
    (("--max-samples", "--max_samples"), "data.max_samples"),
    (("--max-length", "--max_length"), "data.max_length"),
    (("--packing",), "data.packing"),
    (("--eval-fraction",), "data.eval_fraction"),
    (("--method",), "adapter.method"),
    *objective_flags(),
    (("--lora-r", "--lora_r", "--rank"), "adapter.r"),
    (("--lora-alpha", "--lora_alpha"), "adapter.lora_alpha"),
    (("--lora-dropout", "--lora_dropout"), "adapter.lora_dropout"),
    (("--target-modules",), "adapter.target_modules"),
    (("--quantization",), "adapter.quantization"),
    (("--num-virtual-tokens",), "adapter.num_virtual_tokens"),
    (("--prompt-init-text",), "adapter.prompt_init_text"),
]

PRETRAIN_OPTIONS = [
    (("--data",), "data.train_file", "training text: file(s), comma-separated, or a directory"),
    (("--tokenizer",), "data.tokenizer", "tokenizer directory (default: byte-level BPE trained on --data)"),
    (("--max-length",), "data.max_length", "tokens per block"),
]

# The options of the shared sections (schema.py), for both jobs; their help is the field's documentation there.
SHARED_OPTIONS: list[tuple[tuple[str, ...], str]] = [
    (("--output-dir", "--output_dir"), "output.output_dir"), (("--epochs", "--num_epochs"), "schedule.epochs"),
    (("--max-steps",), "schedule.max_steps"), (("--max-tokens",), "schedule.max_tokens"),
    (("--time-budget",), "schedule.time_budget"),
    (("--batch-size", "--batch_size"), "batch.micro_batch_size"),
    (("--grad-accum", "--gradient_accumulation_steps"), "batch.grad_accum_steps"),
    (("--effective-batch-size",), "batch.effective_batch_size"), (("--lr", "--learning_rate"), "optimizer.lr"),
    (("--weight-decay",), "optimizer.weight_decay"), (("--lr-scaling",), "optimizer.lr_scaling"),
    (("--warmup-ratio",), "schedule.warmup_ratio"), (("--warmup-steps",), "schedule.warmup_steps"),
    (("--schedule",), "schedule.schedule"), (("--max-grad-norm",), "optimizer.max_grad_norm"),
    (("--precision",), "hardware.precision"), (("--device",), "hardware.device"), (("--threads",), "hardware.threads"),
    (("--compile",), "hardware.compile"), (("--compile-mode",), "hardware.compile_mode"),
    (("--attention",), "hardware.attention"), (("--measure",), "hardware.measure"),
    (("--gradient-checkpointing",), "hardware.gradient_checkpointing"),
    (("--liger",), "hardware.liger"), (("--parallel",), "distributed.parallel"), (("--backend",), "distributed.backend"),
    (("--seed",), "schedule.seed"), (("--logging-steps",), "logging.logging_steps"),
    (("--eval-steps",), "evaluation.eval_steps"), (("--eval-generate",), "evaluation.eval_generate"),
    (("--eval-max-new-tokens",), "evaluation.eval_max_new_tokens"), (("--save-steps", "--save_steps"), "output.save_steps"),
    (("--save-total-limit",), "output.save_total_limit"), (("--resume",), "output.resume"),
    (("--report-to", "--report_to"), "logging.report_to"), (("--run-name", "--run_name"), "logging.run_name"),
    (("--project",), "logging.project"),
]
SWITCHES = [(("--overwrite",), "output.overwrite", True), (("--no-progress",), "logging.progress", False)]


def _training_job(sub, name: str, help_text: str, description: str, own: list) -> argparse.ArgumentParser:
    """train or pretrain: a config and dotted overrides as positional items, the job's own options and the
    shared sections'."""
    p = sub.add_parser(name, help=help_text, description=description)
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value")
    _add_options(p, own)
    return p


def _add_options(p: argparse.ArgumentParser, own: list[tuple[tuple[str, ...], str, str]]) -> None:

    for option in own:
        flags, key = option[0], option[1]
        help_text = option[2] if len(option) > 2 else train_help(key)
        # --data may be given several times, each FILE:WEIGHT: a mixture (data.sources)
        p.add_argument(*flags, dest=key, default=argparse.SUPPRESS, help=help_text, metavar="V",
                       **({"action": "append"} if key in ("data.path", "objective.reward")
                          else {"nargs": "+"} if key == "objective.reward_weights" else {}))
    for flags, key in SHARED_OPTIONS:
        p.add_argument(*flags, dest=key, default=argparse.SUPPRESS, help=schema.help_for(key), metavar="V",
                       **({"nargs": "+"} if key == "logging.report_to" else {}))  # HF's list: --report-to mlflow wandb
    for flags, key, value in SWITCHES:
        p.add_argument(*flags, dest=key, action="store_const", const=value, default=argparse.SUPPRESS,
                       help=schema.help_for(key) if value is True else f"off: {schema.help_for(key)} ({key} false)")


def train_help(key: str) -> str:
    """A fine-tuning option's help: its field's documentation (settings/finetune.py), the method list where the
    key is the method, and the field's default where it has one and the words do not give it."""
    section, name = key.split(".")
    words = schema.help_for(key, SECTIONS)
    if key == "adapter.method":
        words = f"{' | '.join(METHODS)} | {' | '.join(OBJECTIVES[1:])}: {words}"
    default = {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}[name]
    if default not in (None, (), "", False) and "default" not in words:
        words += f" (default {default})"
    owned = default_text(name) if section == "objective" else None
    if owned and "default" not in words:  # an objective's own setting: each objective's default
        words += f" (default {owned})"
    return words


def build_parser() -> argparse.ArgumentParser:
    parser = cli_jobs.Parser(prog="tunebench",
                             description="Fine-tune and benchmark small causal LMs on the hardware you have.")
    parser.add_argument("--version", action="version", version=f"tunebench {VERSION}")
    cli_jobs.add_debug(parser)
    sub = parser.add_subparsers(dest="job", parser_class=cli_jobs.Parser, metavar="JOB")
    _add_train(sub)
    _add_pretrain(sub)
    cli_jobs.add_tune(sub)
    cli_jobs.add_serve(sub)
    cli_jobs.add_ab_report(sub)
    cli_jobs.add_launch(sub)
    cli_jobs.add_tokenizer(sub)
    cli_jobs.add_generate(sub)
    cli_jobs.add_merge(sub)
    cli_jobs.add_prepare(sub)
    cli_jobs.add_export(sub)
    cli_jobs.add_eval(sub)
    cli_jobs.add_compare(sub)
    cli_jobs.add_report(sub)
    cli_jobs.add_bench_data(sub)
    cli_jobs.add_hw(sub)
    return parser


def _add_train(sub) -> None:
    """train: fine-tuning, its options the settings' (TRAIN_OPTIONS and SHARED_OPTIONS) and the guides' aliases."""
    train = _training_job(sub, "train", "LoRA, QLoRA or full fine-tuning", "Fine-tune a causal LM. Positional "
                          "items: an optional CONFIG.yaml and dotted overrides such as optimizer.lr=1e-4 (or "
                          "train.lr=1e-4).", TRAIN_OPTIONS)
    train.add_argument("--profile", default=None, metavar="NAME",
                       help="hardware profile to start from: cpu, gpu-8-12gb, gpu-24gb, gpu-80gb (or a YAML path)")
    train.add_argument("--use_8bit", "--use-8bit", dest="adapter.quantization", action="store_const", const="8bit",
                       default=argparse.SUPPRESS, help="alias of --quantization 8bit")
    train.add_argument("--use_4bit", "--use-4bit", dest="adapter.quantization", action="store_const", const="4bit",
                       default=argparse.SUPPRESS, help="alias of --quantization 4bit")
    train.add_argument("--allow-download", dest="model.allow_download", action="store_const", const=True,
                       default=argparse.SUPPRESS, help="let transformers fetch a hub model that is not cached")
    cli_jobs.add_debug(train)


def _add_pretrain(sub) -> None:
    """pretrain: a model from scratch, its options the settings' (PRETRAIN_OPTIONS and SHARED_OPTIONS)."""
    pre = _training_job(sub, "pretrain", "train a causal LM from scratch (its own tokenizer, a config's "
                        "architecture)", "Pretrain a model from a YAML config (sections device, model, training, "
                        "data, in the CPU training guide's key names). Positional items: an optional CONFIG.yaml "
                        "and dotted overrides such as optimizer.lr=1e-3 (or the guide's training.learning_rate=1e-3).",
                        PRETRAIN_OPTIONS)
    pre.add_argument("--config", dest="config_file", default=None, metavar="CONFIG.yaml",
                     help="the config (as the CPU training guide's scripts/train.py --config); same as the positional")
    cli_jobs.add_debug(pre)


def train_config(args: argparse.Namespace, world_size: int | None = None):
    """`tunebench train`'s parsed arguments as its run configuration (every value checked there, at `world_size`
    ranks: by default the launched run's)."""
    options: dict[str, Any] = {k: v for k, v in vars(args).items() if "." in k}
    if isinstance(options.get("data.path"), list):

        given = options.pop("data.path")
        if len(given) == 1 and parse_source(given[0])[1] is None:
            options["data.path"] = given[0]
        else:
            options["data.sources"] = given
    configs, overrides = items(args)
    profile = getattr(args, "profile", None)
    hydra = [o for o in overrides if o.startswith("hardware=")]  # the guide's Hydra-style `hardware=gpu_4090`
    if hydra:
        if profile is not None or len(hydra) > 1:
            raise TunebenchError("give the hardware profile once (--profile NAME or hardware=NAME)")
        profile = hydra[0].split("=", 1)[1]
        overrides = [o for o in overrides if o not in hydra]
    cfg = load_config(configs[0] if configs else None, options, overrides, profile, world_size=world_size)
    if configs and cfg.output.resume:
        check_resumed_where_saved(Path(configs[0]), Path(cfg.output.output_dir))
    return cfg


def check_resumed_where_saved(config: Path, out: Path) -> None:
    """`train RUN/config.yaml --resume` continues RUN: a config saved in a run's directory whose output_dir names
    another place (the run was renamed or moved since) is refused, rather than resumed into that other place."""
    home = RunDir(config.resolve().parent)
    if home.config_file != config.resolve() or not (home.checkpoints.is_dir() or home.metrics_file.is_file()):
        return  # not a run's own saved config
    if out.resolve() != home.path:
        raise TunebenchError(f"{config} is the saved config of the run in {home.path}, and its output_dir is {out}; "
                             f"resume it where it is with --output-dir {home.path}")


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def items(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(config files, dotted overrides) among a job's positional items; one config file at most."""
    items = getattr(args, "items", [])
    overrides = [i for i in items if OVERRIDE.match(i)]  # key=value; a path may hold '=' (runs/compile=on/...)
    configs = [i for i in items if i not in overrides]
    if len(configs) > 1:
        raise TunebenchError(f"one config file at most, got {', '.join(configs)}")
    return configs, overrides
