"""DPO or GRPO on 2 ranks against 1 process, the same run otherwise: the same effective batch, steps and seed,
the micro batch fixed so both take the same rows per step (1 process x micro 4, 2 ranks x micro 2). Prints each
run's training time, real tokens/s and wall time. DPO: pairs made from Bitext rows (dpo_from_votes.py's synthetic
A/B store), and the largest difference between the two runs' losses step by step (the ranks must train the same
model). GRPO: GSM8K questions with grpo_gsm8k.py's rewards; each rank samples its own prompts' groups with its own
draws, so the losses differ by sampling, and the figures are each run's sampling and update speeds.
On a 2-core machine two ranks share the cores one process had: the point is that it works (and, for DPO, is
exact), and the figures say what it costs.

    .venv/bin/python benchmarks/ranks.py                 # DPO: 96 prompts, SmolLM2-135M-Instruct, LoRA, 12 steps
    .venv/bin/python benchmarks/ranks.py --objective grpo --steps 6
    .venv/bin/python benchmarks/ranks.py --steps 3 --pairs 24 -- --model tiny   # a smoke run
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


def dpo_args(work: Path, pairs: int) -> list[str]:
    from dpo_from_votes import BITEXT, make_store

    if not BITEXT.exists():
        raise SystemExit(f"the Bitext sample is not at {BITEXT}")
    make_store(work / "votes.sqlite", pairs, 0)
    return ["--method", "dpo", "--data", str(work / "votes.sqlite"), "--lora-dropout", "0"]


def grpo_args(work: Path, prompts: int) -> list[str]:
    from grpo_gsm8k import FORMAT, GSM8K, INSTRUCTION

    if not GSM8K.exists():
        raise SystemExit(f"needs GSM8K at {GSM8K} (../shared/data)")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:prompts]]
    data = work / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["question"] + INSTRUCTION, "answer": r["answer"]}) + "\n"
                            for r in rows))
    return ["--method", "grpo", "--reward", "gsm8k", "--reward", FORMAT, "--data", str(data), "--num-generations",
            "4", "--max-completion-length", "64", "--max-length", "320"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", choices=("dpo", "grpo"), default="dpo")
    p.add_argument("--pairs", type=int, default=96, help="DPO: prompts voted on (one in ten a tie or both bad); "
                                                          "GRPO: GSM8K questions")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--check-args", action="store_true", help="parse the arguments and imports, run nothing")
    p.add_argument("train_args", nargs="*", help="more `tunebench train` options, after --")
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    work = Path(tempfile.mkdtemp(prefix=f"{args.objective}-ranks-"))
    made = dpo_args if args.objective == "dpo" else grpo_args
    common = ["train", *made(work, args.pairs), "--effective-batch-size", "4", "--max-steps", str(args.steps),
              "--eval-fraction", "0", "--no-progress", "--compile", "off", *args.train_args]
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
        steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        runs[name] = (summary, steps, wall)
    (one, one_steps, _), (two, two_steps, _) = runs.values()
    unit = "pairs" if args.objective == "dpo" else "prompts x 4 completions of up to 64 tokens"
    print(f"\n{one['steps']} {args.objective.upper()} steps of {one['effective_batch_size']} {unit}, {one['model']}, "
          f"{one['precision']}, threads: the machine's, split between ranks")
    if args.objective == "dpo":
        print("| run | training s | real tokens/s | wall s |\n|---|---|---|---|")
        for name, (s, _, wall) in runs.items():
            print(f"| {name} | {s['train_time_s']:.1f} | {s['tokens_per_s']:.0f} | {wall:.0f} |")
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(one_steps, two_steps))
        print(f"2 ranks / 1 process: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x tokens/s; largest loss "
              f"difference over {len(one_steps)} steps: {gap:.2e}; runs in {work}")
        return
    print("| run | training s | sampling s | generated tokens/s | update tokens/s | training reward | wall s |\n"
          "|---|---|---|---|---|---|---|")
    for name, (s, steps, wall) in runs.items():
        reward = sum(r["reward"] for r in steps) / len(steps)
        print(f"| {name} | {s['train_time_s']:.1f} | {s['generation_s']:.1f} | {s['generation_tokens_per_s']:.1f} | "
              f"{s['update_tokens_per_s']:.0f} | {reward:.3f} | {wall:.0f} |")
    print(f"2 ranks / 1 process: {one['train_time_s'] / two['train_time_s']:.2f}x training time; runs in {work}")


if __name__ == "__main__":
    main()
