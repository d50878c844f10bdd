"""The remade seed-1 start judged alone on one set, through the arm's run settings (its environment, rewards and kind
column), as agent_rl_arms.judged judges a start; then set against the kept start-judged-SET.json the Xeon made.

    PYTHONPATH=src python judge_start.py RUN START SET.jsonl OUT.json
"""

import dataclasses
import json
import sys
from pathlib import Path

from tunebench.jobs import eval_rewarded
from tunebench.jobs.parts import grpo_run, runner
from tunebench.machine import hardware
from tunebench.model import inference
from tunebench.training.grpo import environment, watch
from tunebench.training.grpo import rewards as rewards_

run, start, data_path, out = sys.argv[1:5]
cfg = eval_rewarded.rewarded_run(run)
o = cfg.objective
env = environment.load(o.environment, o.tool_timeout)
rows = grpo_run.prompts_of(dataclasses.replace(cfg.data, path=data_path), env)
scoring = rewards_.parse(o.reward, o.reward_weights, rewards_.files(o.reward))
plan = hardware.plan("auto", "auto", hardware.detect(), "off")
runner.apply_plan(plan)
placed = inference.load(start, None, None, plan=plan)
figures = eval_rewarded.judged(placed, cfg, rows, env, scoring, watch.Kinds.of(o.kind_column, rows.columns), False)
Path(out).write_text(json.dumps(figures))
kept = json.loads((Path(run).parents[1] / f"start-judged-{Path(data_path).stem}.json").read_text())
before, now = dict(map(tuple, kept["by_row"])), dict(map(tuple, figures["by_row"]))
same = sum((before[k] > 0) == (now[k] > 0) for k in before)
print(f"kept start (Xeon) {sum(v > 0 for v in before.values())}/{len(before)} successes, remade "
      f"{sum(v > 0 for v in now.values())}/{len(now)}; same verdict on {same} of {len(before)} questions")
