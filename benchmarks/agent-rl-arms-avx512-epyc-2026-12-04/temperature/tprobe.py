"""How much a start's sampled episodes differ within a group at each temperature: per kind, success, the share of
groups of 4 with mixed rewards (informative for GRPO), and distinct episodes a group. Training questions only."""
import collections
import json
import sys
import time

sys.path.insert(0, "/work/main/benchmarks")
import agent_rl
from tunebench.model import inference
from tunebench.training.grpo import environment, episodes

rows = [json.loads(l) for l in open("/work/arms/seed0/data/train.jsonl")]
per = int(sys.argv[1]); temps = [float(t) for t in sys.argv[2].split(",")]
picked = []
for kind in ("one", "plus", "sum"):
    picked += [r for r in rows if r["kind"] == kind][-per:]   # the last ones: the arms' first steps draw from the front
placed = inference.load("/work/arms/seed0/start", None)
env = environment.load(str(agent_rl.ENV), 10)
for t in temps:
    began = time.perf_counter()
    eps = episodes.play(placed, env, picked, 6, 48, 1024, 16, 4, t, 0)
    by = collections.defaultdict(list)
    for e in eps:
        by[e.key].append((environment.score(env, e.messages, picked[e.key]) or 0.0, json.dumps(e.messages[2:])))
    out = {}
    for kind in ("one", "plus", "sum"):
        groups = [by[i] for i, r in enumerate(picked) if r["kind"] == kind]
        succ = sum(x[0] > 0 for g in groups for x in g) / sum(len(g) for g in groups)
        mixed = sum(len({x[0] > 0 for x in g}) > 1 for g in groups) / len(groups)
        distinct = sum(len({x[1] for x in g}) for g in groups) / len(groups)
        out[kind] = f"success {succ:.2f} mixed {mixed:.2f} distinct {distinct:.1f}"
    print(f"T={t}: {time.perf_counter() - began:.0f} s; " + "; ".join(f"{k}: {v}" for k, v in out.items()), flush=True)
