"""Is the micro-1 probe's speed what a micro-1 run's steps get? SmolLM2-135M LoRA r8 q/v, fp32, 2 threads, alone.
probe-like: one row at the widest width (128), forward+backward three times, the best of the last two (as
autotune/probe.py times it). run-like: 48 rows of the widths a Bitext run feeds (drawn 40-128), one at a time,
the loss scaled by 8 and an AdamW step every 8 (as bs1_ga8 trains). Both in positions a second."""
import random
import time

import lora_model
import torch

m = lora_model.load()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-4, fused=True)


def fb(x, scale=1.0):
    out = m(input_ids=x, labels=x)
    (out.loss * scale).backward()


for rnd in range(3):
    x = torch.randint(0, 40000, (1, 128))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fb(x)
        times.append(time.perf_counter() - t)
    m.zero_grad(set_to_none=True)
    probe = 128 / min(times[1:])
    rng = random.Random(rnd)
    widths = [rng.randint(40, 128) for _ in range(48)]
    t = time.perf_counter()
    for i, w in enumerate(widths):
        fb(torch.randint(0, 40000, (1, w)), 1 / 8)
        if i % 8 == 7:
            torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    run = sum(widths) / (time.perf_counter() - t)
    print(f"round {rnd}: probe-like {probe:.0f} positions/s (steps {', '.join(f'{s*1000:.0f}' for s in times)} ms), "
          f"run-like {run:.0f} positions/s (mean width {sum(widths)/48:.0f}): run / probe {run/probe:.2f}", flush=True)
