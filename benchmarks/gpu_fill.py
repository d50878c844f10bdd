"""A GPU that is full: SmolLM2-1.7B's shape (random weights, built from a config on the machine, SmolLM2's
tokenizer) at 2,048 tokens a row, LoRA and full fine-tuning in bf16, tunebench against HF Trainer + PEFT, each at
the settings it picks: tunebench's measured micro batch, attention and compile; HF Trainer starting at that micro
batch with its own auto_find_batch_size (halving on each CUDA OOM). benchmarks/vs_hf_trainer.py runs each pair
(one process a side); this script builds the model and the rows and prints one table: real tokens/s, the ratio,
MFU against the GPU's datasheet bf16 peak, and GPU peak memory.

The rows are long texts, so that every row is 2,048 tokens on both sides (no packing or padding to tell apart):
tinyshakespeare, the LLaMA-Factory demo's wiki and C4 texts from ../shared/data, cut into 14,000-character rows.

    python benchmarks/gpu_fill.py --tokenizer DIR --out DIR          # gpu_session.sh's `fill` step
    python benchmarks/gpu_fill.py --tokenizer DIR --size 0.135b --rows 24 --max-length 256   # a CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import scale  # benchmarks/scale.py: run as a script, this directory is on the path

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("TUNEBENCH_SHARED_DATA") or HERE.parents[1] / "shared" / "data")
TEXTS = ("tinyshakespeare/input.txt", "llamafactory-demo-data/wiki_demo.txt", "llamafactory-demo-data/c4_demo.jsonl")
ROW_CHARS = 14_000  # 2,400 tokens or more with SmolLM2's tokenizer (10,000 made some of 1,727), so every row is cut at 2,048


def long_rows(path: Path) -> int:
    """Write the long texts as JSONL rows of ROW_CHARS characters ({"text": ...}); the number written."""
    missing = [t for t in TEXTS if not (SHARED / t).is_file()]
    if missing:
        raise SystemExit(f"gpu_fill.py needs {', '.join(missing)} under {SHARED} (set TUNEBENCH_SHARED_DATA)")
    text = ""
    for name in TEXTS:
        raw = (SHARED / name).read_text()
        text += "\n".join(json.loads(line)["text"] for line in raw.splitlines()) if name.endswith(".jsonl") else raw
    rows = [text[i:i + ROW_CHARS] for i in range(0, len(text) - ROW_CHARS + 1, ROW_CHARS)]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="SmolLM2's tokenizer directory")
    p.add_argument("--size", default="1.7b", choices=list(scale.SHAPES))
    p.add_argument("--methods", default="lora,full")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--rows", type=int, default=200, help="rows used (95%% train): 200 x 2,048 tokens ~ 410k tokens")
    p.add_argument("--effective-batch", type=int, default=16)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "tunebench-fill"), help="logs and JSON")
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "tunebench-scale"))
    p.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)  # gpu_session.sh --dry-run
    args = p.parse_args()
    if args.check_args:
        from harness import check_imports
        check_imports(__file__)
        return
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = scale.build(args.size, Path(args.models) / args.size, args.tokenizer, device)
    data = out / "long_rows.jsonl"
    print(f"{long_rows(data)} rows of {ROW_CHARS} characters -> {data}", flush=True)
    results = {}
    for method in args.methods.split(","):
        saved = out / f"fill_{args.size}_{method}.json"
        proc = subprocess.run([sys.executable, str(HERE / "vs_hf_trainer.py"), "--model", str(model), "--data",
                               str(data), "--samples", str(args.rows), "--max-length", str(args.max_length),
                               "--effective-batch", str(args.effective_batch), "--peer-micro", "auto",
                               "--peer-padding", "longest", "--method", method, "--repeats", "1", "--save", str(saved)])
        results[method] = json.loads(saved.read_text()) if proc.returncode == 0 and saved.is_file() else None
    print(f"\n{args.size} ({model}), max_length {args.max_length}, effective batch {args.effective_batch}, "
          f"{args.rows} rows, bf16 both, one run a side")
    print("| method | tunebench tokens/s (micro x accum) | HF Trainer tokens/s (micro x accum) | ratio | MFU tunebench / HF "
          "| GPU peak tunebench / HF |")
    print("|---|---|---|---|---|---|")
    for method, r in results.items():
        if r is None:
            print(f"| {method} | failed: see the log above | | | | |")
            continue
        tb, hf = r["runs"]["tunebench (auto)"][0], r["runs"]["HF Trainer+PEFT (bf16)"][0]
        mfu = tb.get("mfu")
        mfus = f"{100 * mfu:.1f}% / {100 * mfu * hf['tokens_per_s'] / tb['tokens_per_s']:.1f}%" if mfu else "-"
        gpu = " / ".join(f"{x['gpu_peak_memory_mb']:,.0f} MB" if x.get("gpu_peak_memory_mb") else "-" for x in (tb, hf))
        print(f"| {method} | {tb['tokens_per_s']:,.0f} ({tb['micro_batch_size']} x {tb['grad_accum_steps']}) | "
              f"{hf['tokens_per_s']:,.0f} ({hf['micro_batch_size']} x {hf['grad_accum_steps']}) | "
              f"{tb['tokens_per_s'] / hf['tokens_per_s']:.2f}x | {mfus} | {gpu} |")
    if any(r and r["runs"]["tunebench (auto)"][0].get("peak_tflops_source") for r in results.values()):
        first = next(r for r in results.values() if r)
        print(f"MFU against {first['runs']['tunebench (auto)'][0]['peak_tflops_source']}")


if __name__ == "__main__":
    main()
