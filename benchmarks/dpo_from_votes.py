"""Votes become training, end to end on the built-in model: an A/B store made from Bitext rows, then
`tunebench train --method dpo --data STORE`, timed, with the held-out pairs' reward accuracy before and
after training.

The store stands in for a person voting in `tunebench serve`: for each prompt, one answer is the
dataset's own reply and the other is the reply to a question of another intent (fluent, on topic for
customer support, and wrong for this prompt), shown as A or B at random; the vote goes to the
dataset's reply. One prompt in ten gets a tie or a "both bad" vote instead, which training skips and
counts. These are synthetic votes, not a person's: say so wherever the figure is quoted.

    .venv/bin/python benchmarks/dpo_from_votes.py                  # 120 prompts, SmolLM2-135M-Instruct, LoRA
    .venv/bin/python benchmarks/dpo_from_votes.py --method orpo --pairs 200
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BITEXT = ROOT.parent / "shared" / "data" / "bitext-early-official-4514rows" / \
    "Bitext_Sample_Customer_Support_Training_Dataset.csv"


def make_store(path: Path, prompts: int, seed: int) -> None:
    from tunebench.data import votes

    rows = list(csv.DictReader(BITEXT.open(encoding="utf-8")))
    rng = random.Random(seed)
    picked = rng.sample(rows, prompts)
    votes.open_store(path)
    for i, row in enumerate(picked):
        wrong = rng.choice([r for r in rows if r["intent"] != row["intent"]])["response"]
        right_is_a = rng.random() < 0.5
        a, b = (row["response"], wrong) if right_is_a else (wrong, row["response"])
        vote = ("tie" if i % 20 == 0 else "both_bad") if i % 10 == 0 else ("a" if right_is_a else "b")
        votes.record(path, row["instruction"], "model-x", "model-y", a, b, vote, {"seed": seed}, f"pair{i}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=120, help="prompts voted on (one in ten a tie or both bad)")
    p.add_argument("--method", default="dpo", choices=["dpo", "orpo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("train_args", nargs="*", help="more `tunebench train` options, after --")
    args = p.parse_args()
    if not BITEXT.exists():
        raise SystemExit(f"the Bitext sample is not at {BITEXT}")
    from tunebench.interfaces.cli import main as tunebench

    work = Path(tempfile.mkdtemp(prefix="dpo-votes-"))
    db, out = work / "tunebench-ab.sqlite", work / "run"
    make_store(db, args.pairs, args.seed)
    command = ["train", "--method", args.method, "--data", str(db), "--output-dir", str(out),
               "--eval-fraction", "0.2", "--eval-steps", "0.25", *args.train_args]
    print("tunebench " + " ".join(command))
    start = time.perf_counter()
    code = tunebench(command)
    wall = time.perf_counter() - start
    if code:
        raise SystemExit(code)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_rewards/accuracies" in r]
    summary = json.loads((out / "summary.json").read_text())
    print(f"\n{args.method} on {summary['eval_pairs']} held-out pairs, reward accuracy by step: "
          + ", ".join(f"{r['step']}: {r['eval_rewards/accuracies']:.3f}" for r in evals))
    print(f"{summary['steps']} steps, {summary['train_time_s']:.0f} s of training, {wall:.0f} s for the whole "
          f"command (loading, measuring, evaluating); {summary['tokens_per_s']:.0f} real tokens/s, MFU "
          f"{100 * (summary['mfu'] or 0):.1f}%, peak RSS {summary['peak_memory_mb']:.0f} MB; skipped votes: "
          f"{summary['pairs_skipped']}")


if __name__ == "__main__":
    main()
