"""What tunebench predicts against what happens: each case's plan (time to train, steady tokens/s, first steps'
extra, peak memory) beside what its run measured, from the run's own `plan_check` (summary.json).

Each case is `tunebench train` in a process of its own, from an empty measurement cache (a first run of its shape,
as a new user meets it), then, with --twice, again with the cache the first left (the second run of a shape predicts
from what the first trained at). The cases are the shapes the README's compare never runs: another dataset at a
longer max length, a full fine-tune, compiled layers, a preference objective, and 0.42B / 1.07B Llama shapes
(benchmarks/scale.py's, random weights); `--cases` picks some. GRPO's steps sample as well as train, which no probe
times: its first run's plan has no time estimate ("not yet"), the second predicts from what the first took a step
(run the `grpo` case with --twice).

    python benchmarks/plan_vs_run.py                          # every case, one first run each
    python benchmarks/plan_vs_run.py --cases bitext,dpo --twice
    python benchmarks/plan_vs_run.py --precision fp32         # an AVX2 machine's stand-in on a bf16 CPU

The table: predicted and measured for each figure and their ratio (measured / predicted); the raw summaries and
the commands go to --out (default benchmarks/plan-vs-run-<date>/).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
BITEXT = SHARED / "bitext-early-official-4514rows" / "Bitext_Sample_Customer_Support_Training_Dataset.csv"
ALPACA = SHARED / "llamafactory-demo-data" / "alpaca_en_demo.json"
GSM8K = SHARED / "gsm8k" / "train.jsonl"


def pairs_file(out: Path, n: int = 400) -> Path:
    """Preference pairs from the Bitext rows (or the built-in sample's): each instruction's own reply chosen,
    another row's rejected."""
    path = out / "pairs.jsonl"
    if path.is_file():
        return path
    if BITEXT.is_file():
        with BITEXT.open(newline="") as f:
            rows = [(r["instruction"], r["response"]) for r in csv.DictReader(f)]
    else:
        from tunebench.data import readers
        rows = [(r["instruction"], r["response"]) for r in readers.read_records("builtin:customer-support")]
    with path.open("w") as f:
        for i in range(min(n, len(rows))):
            f.write(json.dumps({"prompt": rows[i][0], "chosen": rows[i][1],
                                "rejected": rows[(7 * i + 13) % len(rows)][1]}) + "\n")
    return path


def cases(out: Path) -> dict[str, Callable[[], list[str]]]:
    """Each case's `tunebench train` arguments, made when the case runs (its data written, its model built)."""
    data = str(BITEXT) if BITEXT.is_file() else "builtin:customer-support"

    def llama(size: str) -> list[str]:
        sys.path.insert(0, str(HERE))
        import scale

        model = scale.build(size, out / "models" / size)
        return ["--model", str(model), "--data", data, "--max-samples", "160", "--max-steps", "6"]

    found = {
        "bitext": lambda: ["--data", data, "--max-samples", "160", "--max-steps", "8"],
        "alpaca-256": lambda: ["--data", str(ALPACA), "--max-length", "256", "--max-samples", "160", "--max-steps", "6"],
        "full": lambda: ["--data", data, "--method", "full", "--max-samples", "160", "--max-steps", "6"],
        "compiled": lambda: ["--data", data, "--compile", "on", "--max-length", "256", "--max-samples", "160",
                             "--max-steps", "8"],
        "dpo": lambda: ["--data", str(pairs_file(out)), "--objective", "dpo", "--max-length", "256", "--max-steps", "4"],
        "grpo": lambda: ["--data", str(GSM8K), "--method", "grpo", "--reward", "gsm8k", "--num-generations", "4",
                         "--max-completion-length", "64", "--effective-batch-size", "4", "--max-samples", "64",
                         "--max-steps", "6"],
        "llama-0.42b": lambda: llama("0.42b"),
        "llama-1.07b": lambda: llama("1.07b"),
    }
    if not ALPACA.is_file():
        found.pop("alpaca-256")
    if not GSM8K.is_file():
        found.pop("grpo")
    return found


def run(name: str, args: list[str], out: Path, cache: Path, precision: str | None, tag: str) -> dict:
    run_dir = out / f"{name}-{tag}"
    cmd = [sys.executable, "-m", "tunebench", "train", *args, "--output-dir", str(run_dir), "--no-progress",
           *(["--precision", precision] if precision else [])]
    env = {**os.environ, "TUNEBENCH_CACHE": str(cache)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / f"{name}-{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"case": name, "run": tag, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "command": cmd}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"case": name, "run": tag, "command": cmd, "plan_check": summary["plan_check"],
            "micro_batch_size": summary["micro_batch_size"], "grad_accum_steps": summary["grad_accum_steps"],
            "precision": summary["precision"]}


def row(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<12} {r['run']:<6} failed: {r['error']}"
    c = r["plan_check"]

    def pair(name: str, fmt: str) -> str:
        p = c[name]
        if p["predicted"] is None:
            return f"{'-':>8} {fmt.format(p['measured']) if p['measured'] is not None else '-':>8} {'':>5}"
        ratio = f"{p['ratio']:>5.2f}" if p["ratio"] is not None else f"{'':>5}"
        return f"{fmt.format(p['predicted']):>8} {fmt.format(p['measured']):>8} {ratio}"

    return (f"{r['case']:<12} {r['run']:<6} {r['micro_batch_size']:>2}x{r['grad_accum_steps']:<2} "
            f"{pair('train_time_s', '{:.1f}')}  {pair('steady_tokens_per_s', '{:,.0f}')}  "
            f"{pair('first_steps_s', '{:.1f}')}  {pair('peak_memory_mb', '{:,.0f}')}"
            # GRPO's plan is a bound for every group teaching: held also to the plan at the largest micro batch fed
            + (f"  as fed {pair('peak_memory_as_fed_mb', '{:,.0f}')}" if "peak_memory_as_fed_mb" in c else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", help="comma-separated: bitext, alpaca-256, full, dpo, grpo, llama-0.42b, llama-1.07b")
    ap.add_argument("--twice", action="store_true", help="run each case again on the cache its first run left")
    ap.add_argument("--precision", help="force a precision on every run (fp32: the AVX2 stand-in)")
    ap.add_argument("--out", help="where the runs, their logs and results.json go")
    a = ap.parse_args()
    out = Path(a.out or HERE / f"plan-vs-run-{datetime.date.today()}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    every = cases(out)
    chosen = a.cases.split(",") if a.cases else list(every)
    unknown = [c for c in chosen if c not in every]
    if unknown:
        sys.exit(f"plan_vs_run: no case {', '.join(unknown)}; the cases: {', '.join(every)}")
    print(f"{'case':<12} {'run':<6} micro  {'train s: plan':>14} {'run':>8} {'x':>5}  {'tokens/s: plan':>14} "
          f"{'run':>8} {'x':>5}  {'first s: plan':>13} {'run':>8} {'':>5}  {'peak MB: plan':>13} {'run':>8} {'x':>5}",
          flush=True)
    results = []
    for name in chosen:
        args = every[name]()
        with tempfile.TemporaryDirectory() as cache:
            for tag in ("first", "second") if a.twice else ("first",):
                results.append(run(name, args, out, Path(cache), a.precision, tag))
                print(row(results[-1]), flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"raw: {out / 'results.json'} and each run's log beside it")


if __name__ == "__main__":
    main()
