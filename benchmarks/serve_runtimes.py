"""Batch-1 chat speed in `tunebench serve` through its two runtimes, on one run: the PyTorch path (tunebench's
decoding loop, the placement serve picks here) against llama.cpp running the run's exports (f16 and the quantized
types given). Each answers the same held-out Bitext prompts, greedy, through serve's own `stream` (what the Chat
tab and the API call); the speed is the reply's tokens/s as the chat shows it (new tokens over the decoding's time,
prompt processing included). Runtimes alternate prompt by prompt; the first prompt of each is a warm-up.

    .venv/bin/python benchmarks/serve_runtimes.py RUN_DIR [--quants q8_0,q4_k_m] [--prompts 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BITEXT = ROOT.parent / "shared" / "data" / "bitext-early-official-4514rows" / \
    "Bitext_Sample_Customer_Support_Training_Dataset.csv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?")
    ap.add_argument("--quants", default="q8_0,q4_k_m", help="exports besides f16 (in RUN/export/, made when missing)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    if not args.run:
        ap.error("give a run directory")
    from tunebench.interfaces.web.app import f16_export
    from tunebench.interfaces.web.models import Registry, entries, stream
    from tunebench.jobs import export

    run = Path(args.run)
    files = [f16_export(str(run))]
    for quant in filter(None, args.quants.split(",")):
        path = run / "export" / f"{export.model_name(run)}-{quant}.gguf"
        if not path.is_file():
            export.export(str(run), "gguf", quant)
        files.append(path)
    registry = Registry(entries([], [str(run)], ggufs=[str(f) for f in files]))
    with BITEXT.open(newline="", encoding="utf-8") as f:
        prompts = [r["instruction"] for r in list(csv.DictReader(f))[-(args.prompts + 1):]]
    speeds: dict[str, list[float]] = {label: [] for label in registry.labels}
    tokens: dict[str, list[int]] = {label: [] for label in registry.labels}
    for i, prompt in enumerate(prompts):
        for label in registry.labels:
            *_, last = stream(registry, label, [{"role": "user", "content": prompt}], args.max_new_tokens, 0.0)
            if i:  # the first prompt warms each runtime up
                speeds[label].append(last.tokens_per_s)
                tokens[label].append(last.new_tokens)
            print(f"prompt {i}: {label:<70} {last.new_tokens:4d} tokens {last.tokens_per_s:7.1f} tokens/s", flush=True)
    torch_label = registry.labels[0]
    base = statistics.median(speeds[torch_label])
    print(f"\n{platform.processor() or platform.machine()}; serve's placement: {registry.device} "
          f"{registry.precision}; {len(prompts) - 1} prompts after a warm-up, greedy, up to {args.max_new_tokens} "
          "new tokens")
    for label in registry.labels:
        med = statistics.median(speeds[label])
        print(f"  {label:<70} median {med:7.1f} tokens/s ({statistics.mean(tokens[label]):.0f} tokens/answer)  "
              f"{med / base:.2f}x PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
