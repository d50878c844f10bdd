"""`tunebench eval` of a run that learned from preferences (DPO, ORPO, KTO): judged the way it was trained. Its
held-out pairs (or judged completions; every row of another --data file instead) are scored by the run's own
objective, as its held-out evaluation scored them (training/objective.evaluate over preference.PreferenceLoss): the
loss, reward accuracy (the share of pairs whose chosen reply the model rewards above the rejected one) and margin,
and the log-probabilities of each side; with --base, the model it started from on the same rows. A next-token
loss or generated answers say nothing of what such a run learned: it was trained to prefer one reply to another.

The reference is the run's start: the base with the adapter off (a LoRA, DoRA or IA3 adapter starts as the
identity, so that is the model the run's reference computed; a prompt-learning adapter's run used the same), or,
for a full fine-tune, the model it started from, loaded beside it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.data import batching
from tunebench.jobs.parts import finetune_data, runner
from tunebench.machine import hardware
from tunebench.machine.distributed import World
from tunebench.model import inference
from tunebench.settings.finetune import RunConfig
from tunebench.settings.rundir import RunDir
from tunebench.training import preference
from tunebench.training.objective import evaluate

FALLBACK_MICRO = 4  # units a batch where the run's plan.json is gone (KTO's reference point is per batch)


def preference_run(path: str | None) -> RunConfig | None:
    """The run's settings where `path` is a training run that learned from preferences, else None."""
    cfg = RunDir.fine_tuned(path)
    return cfg if cfg is not None and cfg.objective.preference else None


def table(run_dir: str, cfg: RunConfig, base: bool, data_path: str | None, device: str, precision: str,
          output_dir: str) -> None:
    """The run (and, with `base`, its start) on the same rows: each one's figures, printed and in scores.json."""
    o = cfg.objective
    own = data_path in (None, cfg.data.path)
    if own and not (cfg.data.eval_fraction or cfg.data.eval_samples):
        raise TunebenchError(f"'{run_dir}' held no {o.unit} out (eval_fraction 0): its figures would be on its "
                             f"training {o.unit}; pass --data with rows it never saw")
    data_cfg = cfg.data if own else dataclasses.replace(cfg.data, path=data_path, sources=())
    reader = finetune_data.JUDGEMENTS[o.data]
    examples = reader.load(data_cfg)  # a file of another format is refused here, before a model loads
    plan = hardware.plan(device, precision, hardware.detect(), "off")
    runner.apply_plan(plan)
    adapter = (Path(run_dir) / "adapter_config.json").is_file()  # else a full fine-tune: a model of its own
    start = inference.trained_on(run_dir) if adapter else cfg.model.name
    chosen = ([("base", start, None)] if base else []) + [(Path(run_dir).name, *((None, run_dir) if adapter
                                                                                   else (run_dir, None)))]
    micro = _micro_batch(run_dir)
    results: dict[str, Any] = {}
    for label, spec, adapter_dir in chosen:
        placed = inference.load(spec, adapter_dir, None, plan=plan)
        data = reader.tokenize(examples, placed.tokenizer, data_cfg)
        keys = np.arange(len(data))
        if own:  # the run's split: its seed and eval fraction over the same rows
            keys = finetune_data.split_rows(cfg, data, [keys], [])[2][0]
        if not len(keys):
            raise TunebenchError(f"no {o.unit} to score: the run held none out, or none fit --max-length "
                                 f"{data_cfg.max_length}; pass --data with other rows")
        # the start is its own reference; a tuned adapter's is the base with it off; a full fine-tune's, its start
        reference = placed.model if label == "base" else None if adapter else \
            inference.load(start, None, None, plan=plan).model
        results[label] = judged(placed, cfg, reference, data, keys, micro)
    where = f"the held-out {o.unit} of {run_dir}" if own else f"the rows of {data_cfg.path}"
    for label, figures in results.items():
        print(json.dumps({"label": label, "rows": where, **figures}, indent=2))
    write_json(Path(output_dir) / "scores.json", {"rows": where, **results})


def judged(placed, cfg: RunConfig, reference, data, keys, micro: int) -> dict[str, Any]:
    """One model's figures on `keys` of `data`: the run's objective over them, as its held-out evaluation ran."""
    o = cfg.objective
    objective = preference.scoring_loss(placed.model, o, placed.autocast_dtype, reference)
    batches = batching.eval_batches(data, keys, micro * 2, placed.tokenizer.pad_token_id,
                                    finetune_data.JUDGEMENTS[o.data].collate)
    with torch.no_grad():
        figures = evaluate(objective, batches, placed.device, World())
    return {k.removeprefix("eval_"): v for k, v in figures.items()}


def _micro_batch(run_dir: str) -> int:
    """The micro batch the run trained (and evaluated) at: its plan.json's."""
    path = RunDir(run_dir).plan_file
    try:
        return int(json.loads(path.read_text())["micro_batch_size"]["value"])
    except (OSError, ValueError, KeyError, TypeError):
        return FALLBACK_MICRO
