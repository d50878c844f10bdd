"""RSS over 40 LoRA steps of SmolLM2-135M in a precision, micro batch 1, at lengths drawn from 40-128 (each step a
new length: `varied`), all at 128 (`fixed`), or drawn and rounded up to a multiple of 16 (`rounded`)."""
import random
import sys
import time

import psutil
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tunebench.model.models import smollm2_dir

precision, mode = sys.argv[1:3]
torch.set_num_threads(2)
dtype = torch.bfloat16 if precision == "bf16" else torch.float32
model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), torch_dtype=dtype, attn_implementation="sdpa")
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
for p in model.parameters():
    if p.requires_grad:
        p.data = p.data.float()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
rng = random.Random(0)
rss = []
start = time.perf_counter()
for _ in range(40):
    t = 128 if mode == "fixed" else rng.randint(40, 128)
    if mode == "rounded":
        t = -(-t // 16) * 16
    ids = torch.randint(0, 49000, (1, t))
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rss.append(round(psutil.Process().memory_info().rss / 2**20))
print(precision, mode, f"{time.perf_counter() - start:.1f} s", "rss", rss[0], rss[9], rss[19], rss[29], rss[39],
      "peak", max(rss), flush=True)
