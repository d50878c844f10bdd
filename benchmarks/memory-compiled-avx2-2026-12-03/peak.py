"""One training step's peak resident memory, eager or with compiled layers (the run's regional compile), three steps
in a fresh process: what benchmarks/README.md's "memory plan of compiled layers" table was measured with.

    python peak.py METHOD PRECISION TARGETS MODE ROWS WIDTH
    python peak.py lora fp32 q_proj,v_proj compile 4 733

METHOD lora | full; PRECISION fp32 | bf16; TARGETS LoRA's modules (comma-separated; ignored for full); MODE eager |
compile. Each line: the step's base resident memory and its peak above it (VmHWM, reset before the step).
"""

import gc
import sys
import time

import psutil
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tunebench.machine.metrics import peak_memory_mb, reset_peak_memory
from tunebench.model import methods
from tunebench.model.models import smollm2_dir
from tunebench.training.autotune import compiler
from tunebench.training.objective import loss_sum


def main() -> None:
    method, precision, targets, mode, rows, width = sys.argv[1:7]
    rows, width = int(rows), int(width)
    torch.set_num_threads(2)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), torch_dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                 target_modules=targets.split(",")))
        if precision == "bf16":
            methods.compute_adapters_in(model)
    else:
        model = model.float()
    model.train()
    if mode == "compile":
        compiler._compile_repeated(model, None)
    ids = torch.randint(0, 49000, (rows, width), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "loss_index": torch.arange(rows * (width - 1))}
    cpu = torch.device("cpu")
    for step in range(3):
        gc.collect()
        time.sleep(0.2)
        base = psutil.Process().memory_info().rss / 2**20
        reset_peak_memory(cpu)
        out = loss_sum(model, batch, dtype if precision == "bf16" else None)
        (out[0] if isinstance(out, tuple) else out).backward()
        model.zero_grad(set_to_none=True)
        print(method, precision, targets, mode, rows, width, "step", step, "base", round(base), "peak-base",
              round(peak_memory_mb(cpu) - base), flush=True)


if __name__ == "__main__":
    main()
