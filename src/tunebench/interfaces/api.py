"""tunebench from Python: the same jobs as the command line, with configs as dataclasses.

    from tunebench import ModelConfig, TrainingConfig, DataConfig, pretrain, train_tokenizer, generate
    tok = train_tokenizer(["corpus.txt"], vocab_size=2000, output_dir="tok")
    summary = pretrain(ModelConfig(vocab_size=2000, d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=128),
                       TrainingConfig(max_steps=100, checkpoint_dir="runs/tiny"),
                       DataConfig(train_file="corpus.txt", tokenizer="tok", max_length=128))
    print(generate("runs/tiny", "Once upon a time"))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunebench.data import tokenizer_training as tokenizer
from tunebench.settings import pretrain as pretrain_config
from tunebench.settings.finetune import load_config
from tunebench.settings.pretrain import DataConfig, ModelConfig, PretrainConfig, PretrainRun, TrainingConfig


def pretrain(model: ModelConfig | None = None, training: TrainingConfig | None = None,
             data: DataConfig | None = None) -> dict[str, Any]:
    """Pretrain from scratch; returns the run's summary (also in `training.checkpoint_dir`/summary.json)."""
    from tunebench.jobs import pretrain as job

    return job.run(PretrainConfig(model or ModelConfig(), training or TrainingConfig(), data or DataConfig()).resolve())


def load_pretrain_config(path: str | Path, **overrides: Any) -> PretrainRun:
    """A pretraining YAML (or a shipped config's name) with dotted overrides: `training__max_steps=10`
    or {"training.max_steps": 10} style keys."""
    return pretrain_config.load(path, {k.replace("__", "."): v for k, v in overrides.items()})


def finetune(config: str | Path | None = None, **options: Any) -> dict[str, Any]:
    """Fine-tune (LoRA, QLoRA, full; DPO, ORPO, KTO or GRPO) as `tunebench train` does. Options
    are dotted config keys with `__` for the dot (`train__max_steps=10`, `adapter__method="full"`,
    `train__objective="dpo"`, `model__name="tiny"`)."""
    from tunebench.jobs import finetune, grpo

    cfg = load_config(config, {k.replace("__", "."): v for k, v in options.items()})
    return (grpo if cfg.objective.samples else finetune).run(cfg)


def train_tokenizer(files: list[str], vocab_size: int, type: str = "bpe", output_dir: str | Path = "tokenizer",
                    text_column: str = "text", overwrite: bool = False) -> dict[str, Any]:
    """Train and save a tokenizer (`tunebench tokenizer train`); returns the vocabulary reached and bytes/token.
    An output directory that holds files is refused unless `overwrite`."""
    return tokenizer.train(list(files), vocab_size, type, output_dir, text_column, overwrite=overwrite)


def generate(model: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, adapter: str | None = None,
             raw: bool | None = None) -> str:
    """Complete `prompt` with a model directory, preset or adapter run. A pretrained model (no chat
    template) continues the text as it is unless `raw=False`."""
    from tunebench.jobs.generate import generate as job

    if raw is None:
        raw = adapter is None and not (Path(model) / "adapter_config.json").exists() and not _has_chat_template(model)
    return job(model, adapter, prompt, max_new_tokens, temperature, raw)


def _has_chat_template(model: str) -> bool:

    cfg = Path(model) / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template")) or \
        (Path(model) / "chat_template.jinja").is_file()


__all__ = ["DataConfig", "ModelConfig", "TrainingConfig", "PretrainConfig", "pretrain", "load_pretrain_config",
           "finetune", "train_tokenizer", "generate"]
