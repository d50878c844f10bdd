"""`tunebench eval` of a run that learned from rewards (GRPO, RFT): judged the way it was trained. Its held-out
prompts (or every row of another --data file) are answered greedily, in its environment where it had one, and
scored by its own rewards, exactly as the run's held-out reward was (training/grpo's held_out_scores and
held_out_figures); with the run's --kind-column, each kind's success and reward beside the whole; with --base, the
model it started from on the same rows; scores.json also keeps each row's reward (`by_row`: its index in the
rows, its reward), for a comparison paired per question. A next-token loss says nothing of such a run: it was
never trained on reference answers.
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
from tunebench.jobs.parts import finetune_data, grpo_run, runner
from tunebench.machine import hardware
from tunebench.machine.distributed import World
from tunebench.model import inference
from tunebench.settings.finetune import RunConfig
from tunebench.settings.rundir import RunDir
from tunebench.training import grpo
from tunebench.training.grpo import environment, watch
from tunebench.training.grpo import rewards as rewards_


def rewarded_run(path: str | None) -> RunConfig | None:
    """The run's settings where `path` is a training run that learned from rewards, else None."""
    cfg = RunDir.fine_tuned(path)
    return cfg if cfg is not None and cfg.objective.samples else None


def table(run_dir: str, cfg: RunConfig, base: bool, data_path: str | None, device: str, precision: str,
          output_dir: str) -> None:
    """The run (and, with `base`, its start) on the same rows: each one's figures, printed and in scores.json."""
    o = cfg.objective
    data = cfg.data if data_path in (None, cfg.data.path) else dataclasses.replace(cfg.data, path=data_path)
    own = data.path == cfg.data.path
    if own and not (cfg.data.eval_fraction or cfg.data.eval_samples):
        raise TunebenchError(f"'{run_dir}' held no prompts out (eval_fraction 0): its answers would be to its training "
                             "prompts; pass --data with rows it never saw")
    env = environment.load(o.environment, o.tool_timeout) if o.environment else None  # refused before a model loads
    rows = grpo_run.prompts_of(data, env)
    scoring = rewards_.parse(o.reward, o.reward_weights, rewards_.files(o.reward))
    rewards_.check_columns(scoring, rows.column_names(), data.path)
    kinds = watch.Kinds.of(o.kind_column, rows.columns) if o.kind_column else None
    plan = hardware.plan(device, precision, hardware.detect(), "off")
    runner.apply_plan(plan)
    adapter = (Path(run_dir) / "adapter_config.json").is_file()  # else a full fine-tune: a model of its own
    tuned = (None, run_dir) if adapter else (run_dir, None)
    start = inference.trained_on(run_dir) if adapter else cfg.model.name
    chosen = ([("base", start, None)] if base else []) + [(Path(run_dir).name, *tuned)]
    results = {}
    for label, spec, adapter in chosen:
        placed = inference.load(spec, adapter, None, plan=plan)
        results[label] = judged(placed, cfg, rows, env, scoring, kinds, own)
    where = f"the held-out prompts of {run_dir}" if own else f"the rows of {data.path}"
    for label, figures in results.items():  # each row's reward in scores.json only: a paired comparison's input
        print(json.dumps({"label": label, "rows": where, **{k: v for k, v in figures.items() if k != "by_row"}},
                         indent=2))
    write_json(Path(output_dir) / "scores.json", {"rows": where, **results})


def judged(placed, cfg: RunConfig, rows, env, scoring: list, kinds: watch.Kinds | None, own: bool) -> dict[str, Any]:
    """One model's greedy answers to the rows (the run's held-out ones where `own`), scored as the run scored them."""
    o = cfg.objective
    tok = placed.tokenizer
    data, _ = grpo_run.tokenized(rows, tok, env, cfg)
    keys = list(range(len(data)))
    if own:  # the run's split: its seed and eval fraction over the same rows
        _, _, parts = finetune_data.split_rows(cfg, data, [np.arange(len(data))], [])
        keys = np.concatenate(parts).tolist()
        if not keys:
            raise TunebenchError("the run held no prompts out: its answers would be to its training prompts; pass "
                                 "--data with other rows")
    on = grpo.Sampling(placed.model, tok, data, rows, scoring, o, placed.device, placed.autocast_dtype)
    draws = grpo_run.draws_of(on, env, rows, cfg)
    held = grpo_run.HeldOutReward(draws, keys, World())
    with torch.no_grad():
        scores = held.mine()
    figures = {k.removeprefix("eval_"): v for k, v in draws.held_out_figures(scores).items()}
    figures["prompts"] = len(keys)
    reward_columns = len(draws.reward_names())
    total = [float(np.nansum(np.asarray(r[:reward_columns]) * draws.weights.numpy())) for r in scores]
    figures["by_row"] = [[int(data.source(k)), t] for k, t in zip(keys, total)]  # (the row's index in --data, reward)
    if kinds is not None:
        of = [kinds.of_row[data.source(k)] for k in keys]
        for i, name in enumerate(kinds.names):
            mine = [t for t, k in zip(total, of) if k == i]
            if mine:
                figures[f"kinds/{name}/success"] = sum(t > 0 for t in mine) / len(mine)
                figures[f"kinds/{name}/reward"] = sum(mine) / len(mine)
                figures[f"kinds/{name}/prompts"] = len(mine)
    return figures
