"""DPO on 2 ranks against 1 process, the same run otherwise: pairs made from Bitext rows (dpo_from_votes.py's
synthetic A/B store), the same effective batch, steps and seed, the micro batch fixed so both take the same
rows per step (1 process x micro 4, 2 ranks x micro 2). Prints each run's training time, real tokens/s and wall
time, and the largest difference between their losses step by step (the ranks must train the same model).
On a 2-core machine two ranks share the cores one process had: the point is that it works and is exact, and
the figures say what it costs.

    .venv/bin/python benchmarks/dpo_ranks.py                 # 96 prompts, SmolLM2-135M-Instruct, LoRA, 12 steps
    .venv/bin/python benchmarks/dpo_ranks.py --steps 3 --pairs 24 -- --model tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=96, help="prompts voted on (one in ten a tie or both bad)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    p.add_argument("train_args", nargs="*", help="more `tunebench train` options, after --")
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    from dpo_from_votes import BITEXT, make_store

    if not BITEXT.exists():
        raise SystemExit(f"the Bitext sample is not at {BITEXT}")
    work = Path(tempfile.mkdtemp(prefix="dpo-ranks-"))
    make_store(work / "votes.sqlite", args.pairs, 0)
    common = ["train", "--method", "dpo", "--data", str(work / "votes.sqlite"), "--effective-batch-size", "4",
              "--max-steps", str(args.steps), "--eval-fraction", "0", "--lora-dropout", "0", "--no-progress",
              "--compile", "off", *args.train_args]
    runs = {}
    for name, launcher, micro in (("1 process", [], "4"), ("2 ranks", ["launch", "--nproc-per-node", "2", "--"], "2")):
        out = work / name.replace(" ", "-")
        command = [sys.executable, "-m", "tunebench", *launcher, *common, "--batch-size", micro, "--output-dir",
                   str(out)]
        print("$ " + " ".join(command[2:]), flush=True)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"{name} failed ({done.returncode}): {done.stderr[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
        losses = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                  if "loss" in r}
        runs[name] = (summary, losses, wall)
    (one, one_losses, one_wall), (two, two_losses, two_wall) = runs.values()
    print(f"\n{one['steps']} DPO steps of {one['effective_batch_size']} pairs, {one['model']}, threads: the "
          f"machine's, split between ranks")
    print("| run | training s | real tokens/s | wall s |\n|---|---|---|---|")
    for name, (s, _, wall) in runs.items():
        print(f"| {name} | {s['train_time_s']:.1f} | {s['tokens_per_s']:.0f} | {wall:.0f} |")
    gap = max(abs(one_losses[k] - two_losses[k]) for k in one_losses)
    print(f"2 ranks / 1 process: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x tokens/s; largest loss "
          f"difference over {len(one_losses)} steps: {gap:.2e}; runs in {work}")


if __name__ == "__main__":
    main()
