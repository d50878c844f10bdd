"""Generation alone, the part of GRPO (and eval --generate, serve) that costs most: tokens generated per second
by the built-in SmolLM2-135M-Instruct at batch 1, 8 and 32, 128 new tokens each (sampled, EOS ignored so every
row runs the full length), through

- `hf`: transformers' `generate` on the model as transformers loads it (fp32), the peer;
- `placed`: transformers' `generate` through inference.Placed (the precision and autocast a training run picks on
  this machine), what eval --generate and serve run;
- `decode`: model/decoding.py's loop under the same Placed, what GRPO samples with;

interleaved over --repeats rounds, each ratio against the peer in the same round.

    .venv/bin/python benchmarks/generation.py
    .venv/bin/python benchmarks/generation.py --batches 1 8 32 --new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from tunebench.model import decoding, inference, models

    loaded = models.resolve("smollm2-135m-instruct")
    tok = loaded.tokenizer
    device, precision, why = inference.placement()
    placed = inference.load("smollm2-135m-instruct", None)
    peer = loaded.model.eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, "
                                       "and then she sold half as many clips in May. How many clips did she sell?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]

    def run(model, generate, batch: int) -> float:
        x = ids.repeat(batch, 1)
        kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                      pad_token_id=tok.pad_token_id, use_cache=True)
        torch.manual_seed(0)
        began = time.perf_counter()
        out = generate(**kwargs)
        seconds = time.perf_counter() - began
        return (out.shape[1] - x.shape[1]) * batch / seconds

    def hf(**kwargs):
        with torch.no_grad():
            return peer.generate(**kwargs)

    def decode(input_ids, attention_mask, temperature, top_p, max_new_tokens, pad_token_id, **_):
        with placed.running() as model:  # EOS ignored, as min_new_tokens makes generate do
            return torch.cat([input_ids, decoding.decode(model, input_ids, attention_mask, max_new_tokens, -1,
                                                         pad_token_id, temperature, top_p)], 1)

    paths = {"hf": hf, "placed": placed.generate, "decode": decode}
    for fn in paths.values():
        run(None, fn, 1)  # warm-up: first-call allocations out of the figures
    figures = {(p, b): [] for p in paths for b in args.batches}
    for r in range(args.repeats):
        for b in args.batches:
            for name, fn in paths.items():
                figures[(name, b)].append(run(None, fn, b))
                print(f"round {r + 1}: {name:<10} batch {b:>3}: {figures[(name, b)][-1]:8.1f} tokens/s", flush=True)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"placed and decode: {device}, {precision} ({why}); {args.new_tokens} new tokens, medians of {args.repeats}")
    print(f"{'batch':>5} {'hf tokens/s':>12} {'placed':>8} {'ratio':>6} {'decode':>8} {'ratio':>6}")
    for b in args.batches:
        hf_, placed_, ours = (statistics.median(figures[(p, b)]) for p in paths)
        ratios = [statistics.median(o / h for o, h in zip(figures[(p, b)], figures[("hf", b)]))
                  for p in ("placed", "decode")]
        print(f"{b:>5} {hf_:>12.1f} {placed_:>8.1f} {ratios[0]:>6.2f} {ours:>8.1f} {ratios[1]:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
