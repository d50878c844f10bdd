"""Measuring pays for itself at every size: tunebench's first run of a shape against HF Trainer + PEFT, end to end.

Llama-family shapes with random weights and SmolLM2's tokenizer: 0.135B (SmolLM2-135M's), 0.42B (hidden 1024, 24
layers, 16 heads, 4 KV heads, FFN 4096) and 1.07B (hidden 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632). LoRA r=8 on q/v at
the study's settings (max_length 128, effective batch 8), Bitext rows (or the built-in sample), 10 optimizer
steps, bf16 where the CPU has it. Each side runs in its own process, alternating (benchmarks/vs_hf_trainer.py),
and tunebench starts from an empty cache of measurements: a first run of the shape, its measuring included in
its wall time. The table: real tokens/s, the ratio, peak RSS, each process's wall time, tunebench's measuring, and
its memory plan (the settings table's memory_plan row) against the peak its training loop measured.

    python benchmarks/scale.py                    # 0.42B and 1.07B, one run a side
    python benchmarks/scale.py --sizes 0.135b,0.42b,1.07b
    python benchmarks/scale.py --sizes 0.42b --repeats 2
    python benchmarks/scale.py --sizes 0.42b --precision fp32   # both sides fp32: an AVX2 machine's stand-in
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {  # name: (hidden, layers, heads, KV heads, FFN)
    "0.135b": (576, 30, 9, 3, 1536),  # SmolLM2-135M's shape
    "0.42b": (1024, 24, 16, 4, 4096),
    "1.07b": (2048, 22, 32, 4, 5632),
    "1.7b": (2048, 24, 32, 32, 8192),  # SmolLM2-1.7B's shape (gpu_fill.py's)
}


def build(name: str, out: Path, tokenizer: str | None = None, device: str = "cpu") -> Path:
    """The shape as a model directory (random weights, seeded) with SmolLM2's tokenizer (the built-in model's, or
    the directory `tokenizer`), initialised on `device`; built once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunebench.model import models

    hidden, layers, heads, kv, ffn = SHAPES[name]
    tok = models.load_tokenizer(tokenizer) if tokenizer else models.resolve(models.SMOLLM2).tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.device(device):  # a 1.7B model initialises in seconds on a GPU, in a minute on a few cores
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}", flush=True)
    part = out.with_name(out.name + ".part")  # renamed when whole: a cut build is not taken for a built one
    model.save_pretrained(part)
    tok.save_pretrained(part)
    part.rename(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.42b,1.07b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each run (effective batch 8)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "tunebench-scale"),
                   help="where the shapes are built (kept for the next run)")
    p.add_argument("--measure", default="bounded", choices=["bounded", "full"],
                   help="tunebench's --measure (full: every kernel and micro batch, as before the budget)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32"],
                   help="fp32: both sides in fp32, standing in for a CPU without native bf16 (AVX2) on one that has it")
    p.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown size(s) {', '.join(unknown)}: the sizes are {', '.join(SHAPES)}")
    if args.check_args:
        from harness import check_imports  # benchmarks/harness.py: run as a script, this directory is on the path
        check_imports(__file__)
        return
    rows = []
    samples = round(args.steps * 8 / 0.95) + 1  # 5% held out: `steps` batches of 8 training rows
    for name in sizes:
        model = build(name, Path(args.models) / name)
        with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile(suffix=".json") as saved:
            env = dict(os.environ, TUNEBENCH_CACHE=cache)  # a first run of the shape: nothing measured before
            subprocess.run([sys.executable, str(HERE / "vs_hf_trainer.py"), "--model", str(model), "--samples",
                            str(samples), "--repeats", str(args.repeats), "--measure", args.measure, "--save", saved.name,
                            *(["--precision", "fp32", "--peers", "fp32"] if args.precision == "fp32" else [])],
                           env=env, check=True)
            result = json.loads(Path(saved.name).read_text())
        peer = f"HF Trainer+PEFT ({'fp32' if args.precision == 'fp32' else 'bf16'})"
        tb, hf = (result["medians"][side] for side in ("tunebench (auto)", peer))
        measuring = sorted(r["measure_s"] for r in result["runs"]["tunebench (auto)"])
        rows.append((name, tb, hf, measuring[len(measuring) // 2], result["runs"]["tunebench (auto)"][0]))
    print(f"\n{args.steps} steps, max_length 128, effective batch 8, LoRA r=8 on q/v; medians of {args.repeats}; "
          f"tunebench from an empty measurement cache, --measure {args.measure}"
          + (", both sides fp32" if args.precision == "fp32" else ""))
    print("| model | tunebench tokens/s | HF tokens/s | ratio | peak RSS tunebench / HF | process wall tunebench / HF "
          "| tunebench measuring | MFU | memory plan / training loop's peak | chosen |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, tb, hf, measure_s, run in rows:
        chosen = ", ".join(f"{k} {v}" for k, v in run["chosen"].items() if k in ("micro_batch_size", "attention"))
        print(f"| {name} | {tb['tokens_per_s']:.0f} | {hf['tokens_per_s']:.0f} | "
              f"{tb['tokens_per_s'] / hf['tokens_per_s']:.2f}x | {tb['peak_memory_mb'] / 1024:.1f} / "
              f"{hf['peak_memory_mb'] / 1024:.1f} GB | {tb['total_s']:.0f} / {hf['total_s']:.0f} s | {measure_s:.0f} s | "
              f"{100 * tb['mfu']:.1f}% | {run['memory_plan_mb'] / 1024:.2f} / {run['loop_peak_mb'] / 1024:.2f} GB "
              f"({run['memory_plan_mb'] / run['loop_peak_mb'] - 1:+.0%}) | {chosen} |")


if __name__ == "__main__":
    main()
