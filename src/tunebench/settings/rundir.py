"""A run's output directory: its layout (RunDir, the one place that names its files) and the run read back
from it. Opening a directory for a run (never silently replacing an earlier one, the checkpoint to resume
from) is checkpoint.open_run's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError


@dataclass(frozen=True)
class RunDir:
    """A run's directory, as every job writes it and every job reads it back: eval, export, merge, serve,
    generate and resume take a run's config, prompt format, base model and kind from here, through the
    safe YAML loader, never from a guess at its files."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    # -- the layout
    @property
    def config_file(self) -> Path:  # the resolved configuration (config.yaml)
        return self.path / "config.yaml"

    @property
    def plan_file(self) -> Path:  # every decision with its reason
        return self.path / "plan.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def answers_file(self) -> Path:  # --eval-generate's answers to held-out rows
        return self.path / "eval_answers.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter_config_file(self) -> Path:  # PEFT's: the run saved an adapter
        return self.path / "adapter_config.json"

    # -- the run, read back
    def raw_config(self) -> dict[str, Any]:
        """config.yaml as the safe loader reads it; {} when the directory has none (a plain HF directory)."""
        from tunebench.settings.finetune import read_yaml

        return read_yaml(self.config_file) if self.config_file.is_file() else {}

    def kind(self) -> str:
        """"adapter" (a PEFT adapter over a base), "pretrain" (a `tunebench pretrain` model, trained on plain
        text), "model" (a whole model: a full fine-tune or a merge) or "none"."""
        if self.adapter_config_file.is_file():
            return "adapter"
        raw = self.raw_config()
        if "training" in raw and "train" not in raw or "train_file" in (raw.get("data") or {}):
            return "pretrain"  # the pretraining schema's sections (before and since the shared sections)
        return "model" if (self.path / "config.json").is_file() else "none"

    def peft_type(self) -> str | None:
        if not self.adapter_config_file.is_file():
            return None
        return json.loads(self.adapter_config_file.read_text()).get("peft_type")

    def template(self) -> str | None:
        """The prompt format the run trained with (data.template); None when the directory holds no training
        run's config that names one."""
        data = self.raw_config().get("data")
        template = data.get("template") if isinstance(data, dict) else None
        return template if isinstance(template, str) else None

    def base_model(self) -> str:
        """The model an adapter was trained on: the run's model.name, else PEFT's record of it."""
        model = self.raw_config().get("model")
        if isinstance(model, dict) and isinstance(model.get("name"), str):
            return model["name"]
        if self.adapter_config_file.is_file():
            return json.loads(self.adapter_config_file.read_text())["base_model_name_or_path"]
        raise TunebenchError(f"'{self.path}' holds no adapter_config.json; point --adapter at a tunebench output dir")

    def train_config(self):
        """The fine-tuning run's configuration (config.RunConfig), loaded and validated as at its start."""
        from tunebench.settings.finetune import load_config

        return load_config(self.config_file)
