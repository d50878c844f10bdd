"""A run's output directory: its layout (RunDir, the one place that names its files) and the run read back
from it. Opening a directory for a run (never silently replacing an earlier one, the checkpoint to resume
from) is checkpoint.open_run's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.settings import objectives
from tunebench.settings.finetune import load_config, read_yaml


@dataclass(frozen=True)
class Summary:
    """A finished run's figures, as its summary.json holds them and every reader takes them: compare's results
    row, tune's trial, the studio's runs table, the run report. The figures every run has are fields (speed over
    the measured steps, memory, losses, the batch it trained with); the keyed families stay in `extra` under their
    own names (eval_loss/<dataset>, eval_rewards/..., the task scores, the monitor's means, GRPO's sampling)."""

    device: str
    precision: str
    steps: int
    samples: int
    tokens: int
    duration_s: float  # the training loop's wall time: its steps, the evaluations and checkpoints between them, the last save
    train_time_s: float  # the loop's
    tokens_per_s: float | None  # real (unpadded) tokens over the measured steps, all ranks
    samples_per_s: float | None
    peak_memory_mb: float
    mfu: float | None
    peak_tflops_source: str
    final_train_loss: float | None
    eval_loss: float | None
    micro_batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    max_length: int
    method: str  # lora, qlora, ... or pretrain
    world_size: int = 1
    it_per_s: float | None = None  # optimizer steps a second, as the study counts them
    measure_s: float | None = None  # the measured settings' time, apart from training
    model: str | None = None
    quantization: str = "none"
    objective: str = "sft"
    trainable_parameters: int | None = None  # fine-tuning
    parameters: int | None = None  # pretraining: the whole model trains
    extra: dict[str, Any] = field(default_factory=dict)
    written: tuple[str, ...] = field(default=(), repr=False, compare=False)  # summary.json's keys, in its order

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        fields = [f for f in dataclasses.fields(cls) if f.name not in ("extra", "written")]
        names = {f.name for f in fields}
        missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING]
        if missing:
            raise TunebenchError(f"this summary.json lacks {', '.join(missing)}: not a finished tunebench run's "
                                 "summary; rerun the run (or remove the file)")
        return cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names},
                   written=tuple(d))

    def to_dict(self) -> dict[str, Any]:
        """summary.json's shape: one flat object, the fields and the extras side by side; a summary read from a
        file gives back that file's keys, in its order (a default is not a figure the run reported)."""
        if self.written:
            return {k: self.get(k) for k in self.written}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "written")} \
            | self.extra

    def get(self, name: str, default: Any = None) -> Any:
        """A figure by its summary.json name, field or extra (a task score, eval_rewards/accuracies)."""
        return getattr(self, name) if name in self.__dataclass_fields__ and name not in ("extra", "written") else \
            self.extra.get(name, default)


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
    def weights_stamp(self) -> dict[str, list[int]]:
        """{file: [bytes, mtime_ns]} of the run's saved weights (an adapter's or a whole model's): what a file
        made from them (a served GGUF) was made from; a retrained run (`train --overwrite`) stamps differently.
        Size and time, not a hash: a hash of a full model's weights costs seconds at every serve."""
        found = {}
        for pattern in ("adapter_model.*", "*.safetensors", "pytorch_model*.bin"):
            for f in sorted(self.path.glob(pattern)):
                st = f.stat()
                found[f.name] = [st.st_size, st.st_mtime_ns]
        return found

    def raw_config(self) -> dict[str, Any]:
        """config.yaml as the safe loader reads it; {} when the directory has none (a plain HF directory)."""
        return read_yaml(self.config_file) if self.config_file.is_file() else {}

    def objective(self) -> objectives.Objective | None:
        """The run's objective as its config.yaml names it, None where it names none (a pretraining run, a plain
        HF directory) or the section does not make one (a file edited by hand): what its report draws."""
        try:
            section = self.raw_config().get("objective")
            return objectives.build(section) if isinstance(section, dict) else None
        except (TunebenchError, TypeError, ValueError, OSError):
            return None

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

    def summary(self) -> Summary | None:
        """The run's figures, None until it has finished (no summary.json yet); a file that is not a tunebench
        summary is refused with its path."""
        if not self.summary_file.is_file():
            return None
        try:
            return Summary.from_dict(json.loads(self.summary_file.read_text()))
        except (TunebenchError, json.JSONDecodeError, TypeError) as e:
            raise TunebenchError(f"{self.summary_file}: {e}") from None

    def train_config(self):
        """The fine-tuning run's configuration (config.RunConfig), loaded and validated as at its start."""
        return load_config(self.config_file)

    @staticmethod
    def fine_tuned(path: str | None):
        """The configuration of the fine-tuning run at `path` (train_config), or None where `path` is none, holds no
        config.yaml or is a pretraining run (what `tunebench eval` asks before judging a run as it trained)."""
        run = RunDir(path) if path else None
        if run is None or not run.config_file.is_file() or run.kind() == "pretrain":
            return None
        return run.train_config()
