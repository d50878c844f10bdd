import sys, time, gc, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
from tunebench.model.models import smollm2_dir
from tunebench.model import methods
from tunebench.training.autotune import compiler
from tunebench.training.objective import loss_sum
from tunebench.machine.metrics import reset_peak_memory, peak_memory_mb, _rss_peak_mb
import psutil
torch.set_num_threads(2)
method, precision, targets, mode, rows, width = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
dt = torch.bfloat16 if precision == "bf16" else torch.float32
m = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), torch_dtype=dt, attn_implementation="sdpa")
m.config.use_cache = False
if method == "lora":
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets.split(",")))
    if precision == "bf16": methods.compute_adapters_in(m)
else:
    m = m.float()
m.train()
if mode == "compile":
    compiler._compile_repeated(m, None)
ids = torch.randint(0, 49000, (rows, width), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "loss_index": torch.arange(rows * (width - 1))}
dev = torch.device("cpu")
for i in range(3):
    gc.collect(); time.sleep(0.2)
    base = psutil.Process().memory_info().rss / 2**20
    reset_peak_memory(dev)
    loss, _ = loss_sum(m, batch, dt if precision == "bf16" else None)[:2] if False else (None, None)
    out = loss_sum(m, batch, dt if precision == "bf16" else None)
    l = out[0] if isinstance(out, tuple) else out
    l.backward()
    m.zero_grad(set_to_none=True)
    print(method, precision, targets, mode, rows, width, "step", i, "base", round(base), "peak-base", round(peak_memory_mb(dev) - base), flush=True)
