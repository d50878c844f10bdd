"""One process x N threads against N processes x 1 thread (torch.distributed DDP, gloo) on this CPU.

The same job at the same global batch both ways, through the real CLI (`tunebench train|pretrain`
and `tunebench launch --nproc-per-node N`), one run at a time, alternating, each in its own
process(es). Printed: real tokens/s (warm-up steps excluded), peak memory summed over the ranks,
and the ratio; then what the settings table picks for threads per rank under launch.

    python benchmarks/processes_vs_threads.py                      # LoRA on SmolLM2 and pretraining cpu_small_model
    python benchmarks/processes_vs_threads.py --jobs lora --steps 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def job_args(job: str, out: str, steps: int, micro: int) -> list[str]:
    common = ["--output-dir", out, "--max-steps", str(steps), "--batch-size", str(micro), "--overwrite",
              "--no-progress"]
    if job == "lora":  # the study's LoRA on the default model and built-in data, effective batch 8
        return ["train", "--effective-batch-size", "8", "--max-length", "128", "--compile", "off", *common]
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"pretraining needs {SHAKESPEARE} (../shared/data)")
    return ["pretrain", "cpu_small_model", "--data", str(SHAKESPEARE), "--effective-batch-size", "8",
            "--max-length", "256", "--compile", "off", "training.eval_steps=null", "training.save_steps=null",
            "training.logging_steps=1", "data.max_eval_blocks=8", *common]


def run(job: str, nproc: int, threads: int, steps: int, micro: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run")
        args = job_args(job, out, steps, micro) + ["--threads", str(threads)]
        cmd = [sys.executable, "-m", "tunebench"] + (["launch", "--nproc-per-node", str(nproc), "--"]
                                                     if nproc > 1 else []) + args
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        plan = json.loads((Path(out) / "plan.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "peak_mb": summary["peak_memory_mb_total"],
            "eval_loss": summary["eval_loss"], "plan": plan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="lora,pretrain")
    p.add_argument("--nproc", type=int, default=2, help="processes (and threads of the single process)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    for job in args.jobs.split(","):
        micro = 4  # per process, both ways: 1 x 4 x accumulation 2, or 2 ranks x 4 x 1
        results: dict[str, list[dict]] = {"threads": [], "processes": []}
        for _ in range(args.repeats):
            results["threads"].append(run(job, 1, args.nproc, args.steps, micro))
            results["processes"].append(run(job, args.nproc, 1, args.steps, micro))
        median = {k: {m: statistics.median(r[m] for r in v) for m in ("tokens_per_s", "peak_mb")}
                  for k, v in results.items()}
        t, q = median["threads"], median["processes"]
        print(f"{job}: 1 process x {args.nproc} threads {t['tokens_per_s']:,.0f} tokens/s, peak {t['peak_mb']:,.0f} MB; "
              f"{args.nproc} processes x 1 thread {q['tokens_per_s']:,.0f} tokens/s, peak {q['peak_mb']:,.0f} MB (all "
              f"ranks); processes / threads = {q['tokens_per_s'] / t['tokens_per_s']:.2f}x speed, "
              f"{q['peak_mb'] / t['peak_mb']:.2f}x memory")
        decided = {d["setting"]: d for d in results["processes"][0]["plan"]["decisions"]}
        print(f"  under launch the table says: world {decided['world']['value']} ({decided['world']['reason']}); "
              f"parallel {decided['parallel']['value']} ({decided['parallel']['reason']})")
    # What the table picks for threads when not told: ask the planner as each rank would.
    from tunebench.machine import hardware
    hw = hardware.detect()
    for ranks in (1, args.nproc):
        d = hardware.plan("cpu", "auto", hw, env={"RANK": "0", "LOCAL_WORLD_SIZE": str(ranks)}).decision("torch_threads")
        print(f"threads per rank with {ranks} rank(s) on this machine: {d.value} ({d.reason})")


if __name__ == "__main__":
    main()
