"""GRPO's sampling alone, as a step makes it: `--prompts` GSM8K questions x `--generations` completions of up to
`--new-tokens` tokens at temperature 1, each ending at its EOS, decoded as a GRPO step's Completions.draw decodes
them (training/grpo), on the built-in SmolLM2-135M-Instruct in the precision a run picks here. Prints generated tokens (to each EOS, as GRPO counts them)
a second over `--repeats` decodes, each seeded alike, after one untimed decode.

The same script runs against another checkout's code (one from 2026-12-03 on: it calls grpo.cut_after_eos), for a
paired before/after on one machine:

    .venv/bin/python benchmarks/sampling.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/sampling.py

Needs ../shared/data (GSM8K); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lora", default="", help="comma-separated modules to wrap in a LoRA adapter (r 8, alpha 16, "
                    "PEFT's get_peft_model), as a LoRA run samples through its adapter: e.g. q_proj,v_proj")
    args = ap.parse_args()
    if not GSM8K.exists():
        raise SystemExit(f"needs GSM8K at {GSM8K} (../shared/data)")

    import torch

    import tunebench
    from tunebench.model import decoding, inference
    from tunebench.training import grpo

    placed = inference.load("smollm2-135m-instruct", None)
    tok = placed.tokenizer
    if args.lora:
        from peft import LoraConfig, get_peft_model

        placed.model = get_peft_model(placed.model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                               target_modules=args.lora.split(",")))
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:args.prompts]]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for q in questions]

    def once() -> tuple[int, float]:
        torch.manual_seed(0)
        started = time.perf_counter()
        ids, mask = decoding.left_padded(prompts, tok.pad_token_id, placed.device)  # as Completions.draw decodes
        out = grpo.cut_after_eos(placed.decode(ids, mask, args.new_tokens, 1.0, 1.0, repeat=args.generations),
                                 tok.eos_token_id)
        return sum(map(len, out)), time.perf_counter() - started

    once()
    runs = [once() for _ in range(args.repeats)]
    speeds = [n / s for n, s in runs]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, tunebench at "
          f"{Path(tunebench.__file__).parents[1]}, {placed.device}, autocast {placed.autocast_dtype}"
          + (f", LoRA on {args.lora}" if args.lora else ""))
    print(f"{args.prompts} prompts x {args.generations}, up to {args.new_tokens} new tokens: "
          f"{runs[0][0]} tokens a decode; generated tokens/s median {statistics.median(speeds):.1f} "
          f"(min {min(speeds):.1f}, max {max(speeds):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
