"""What each GGUF type does to a real run's task: a SmolLM2-135M-Instruct LoRA run on the Bitext sample, exported
in every type `tunebench export` writes, each file answering the run's held-out rows in llama.cpp (`eval --gguf`:
size, ROUGE-L, chrF, tokens/s at batch 1) in one table beside the PyTorch run; then `export --quant auto` on the
same run, and what it picked. Every step is the CLI a user types; the outputs are kept in --out.

    .venv/bin/python benchmarks/quant_task.py --out benchmarks/quant-task-DATE  [--run DIR] [--rows 600] [--steps 75]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BITEXT = "bitext-early-official-4514rows/Bitext_Sample_Customer_Support_Training_Dataset.csv"
TYPES = ("f16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0", "q3_k_m",
         "q2_k")


def tunebench(log: Path, *args: str) -> float:
    """One CLI command, its output appended to `log` and echoed; its wall seconds."""
    began = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ tunebench {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([sys.executable, "-m", "tunebench", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        f.write(done.stdout)
    print(done.stdout[-3000:], flush=True)
    if done.returncode != 0:
        raise SystemExit(f"tunebench {args[0]} failed ({done.returncode}); see {log}")
    return time.perf_counter() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", default=None, help="a finished run on the Bitext sample (default: train one)")
    ap.add_argument("--data", default=None, help="the Bitext sample CSV (default: ../shared/data's)")
    ap.add_argument("--rows", type=int, default=600, help="rows of the Bitext sample the run trains on")
    ap.add_argument("--steps", type=int, default=75)
    ap.add_argument("--generate", type=int, default=30, help="held-out rows each file answers")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    data = args.data or str(ROOT.parent / "shared" / "data" / BITEXT)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    run = Path(args.run) if args.run else out / "run"
    seconds = {}
    if not args.run:
        seconds["train"] = tunebench(log, "train", "--data", data, "--max-samples", str(args.rows), "--max-steps",
                                     str(args.steps), "--output-dir", str(run), "--no-progress")
    files = []
    for quant in TYPES:
        path = run / "export" / f"{run.name}-{quant}.gguf"
        if not path.is_file():
            seconds[f"export {quant}"] = tunebench(log, "export", str(run), "--quant", quant)
        files.append(path)
    gen = ["--generate", str(args.generate), "--max-new-tokens", str(args.max_new_tokens)]
    seconds["eval"] = tunebench(log, "eval", "--adapter", str(run), "--data", data, "--max-samples", str(args.rows),
                                *gen, "--output-dir", str(out / "eval"),
                                *(a for f in files for a in ("--gguf", str(f))))
    seconds["export --quant auto"] = tunebench(log, "export", str(run), "--quant", "auto", "--quant-rows",
                                               str(args.generate), "--max-new-tokens", str(args.max_new_tokens),
                                               "-o", str(out / "auto"))
    with log.open("a") as f:
        f.write("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + "\n")
    print("seconds:", ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
