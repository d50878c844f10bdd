"""GRPO on GSM8K with verifiable rewards: SmolLM2-135M-Instruct (the built-in model), LoRA, every hardware setting
auto, the `gsm8k` reward (the final number equals the reference's) plus a `format` reward (the completion ends with
a number: a 135M model never writes GSM8K's '#### N', and a reward no completion earns teaches nothing), on questions from ../shared/data/gsm8k/train.jsonl. Prints the held-out reward (greedy answers to
prompts the run never trains on) before and after, and the speeds of sampling and of the update, measured apart.

    .venv/bin/python benchmarks/grpo_gsm8k.py                       # 50 steps of 4 prompts x 4 completions
    .venv/bin/python benchmarks/grpo_gsm8k.py --steps 100 --generations 8

Needs ../shared/data (GSM8K); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
INSTRUCTION = "\nThink briefly, then end your answer with the final number."
FORMAT = r"format:\d\.?\s*$"  # the answer ends with its number (what the gsm8k reward then reads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step (the effective batch)")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--completion-length", type=int, default=128)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    args = ap.parse_args()
    if not GSM8K.exists():
        raise SystemExit(f"needs GSM8K at {GSM8K} (../shared/data)")
    root = Path(tempfile.mkdtemp(prefix="tunebench-grpo-"))
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:args.rows]]
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["question"] + INSTRUCTION, "answer": r["answer"]}) + "\n"
                            for r in rows))
    out = root / "run"
    argv = [sys.executable, "-m", "tunebench", "train", "--method", "grpo", "--reward", "gsm8k", "--reward", FORMAT,
            "--data", str(data), "--num-generations", str(args.generations), "--max-completion-length",
            str(args.completion_length), "--max-length", str(256 + args.completion_length), "--effective-batch-size",
            str(args.prompts), "--max-steps", str(args.steps), "--eval-fraction", str(args.held_out / args.rows),
            "--output-dir", str(out), "--no-progress", *(["--model", args.model] if args.model else [])]
    print(" ".join(argv[2:]), flush=True)
    began = time.perf_counter()
    done = subprocess.run(argv, text=True, capture_output=True)
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        if line.startswith(("held-out reward", "sampling:", "  micro_batch_size", "  precision", "  attention")) \
                or " steps in " in line:
            print(line)
    s = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward" in r]
    first, last = steps[: len(steps) // 5 or 1], steps[-(len(steps) // 5 or 1):]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; "
          f"{s['model']} {s['method']}, {s['precision']}, {args.steps} steps of {args.prompts} prompts x "
          f"{args.generations} completions of up to {args.completion_length} tokens")
    print(f"held-out reward ({round(args.held_out)} prompts, greedy): before {s['eval_reward_before']:.4f}, after "
          f"{s['eval_reward']:.4f} (gsm8k {s.get('eval_rewards/gsm8k/mean', 0):.4f}, format "
          f"{s.get('eval_rewards/format/mean', 0):.4f})")
    print(f"training reward, first and last fifth of the steps: {mean(first, 'reward'):.4f} -> {mean(last, 'reward'):.4f}"
          f" (format {mean(first, 'rewards/format/mean'):.4f} -> {mean(last, 'rewards/format/mean'):.4f}; gsm8k "
          f"{mean(first, 'rewards/gsm8k/mean'):.4f} -> {mean(last, 'rewards/gsm8k/mean'):.4f}); "
          f"completion length {mean(first, 'completions/mean_length'):.0f} -> {mean(last, 'completions/mean_length'):.0f}")
    print(f"sampling: {s['generated_tokens']:,} tokens in {s['generation_s']:.0f} s = "
          f"{s['generation_tokens_per_s']:.0f} generated tokens/s; update: {s['update_tokens_per_s']:.0f} tokens/s "
          f"over {s['update_s']:.0f} s; training {s['duration_s']:.0f} s, the whole command {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
