"""One GRPO/RFT-shaped probe step (4 rows x 1,024 tokens, SmolLM2-135M LoRA q/v fp32, tunebench's attention kernel),
repeated three times as the probe repeats it: VmHWM and VmRSS after each repeat.

    PYTHONPATH=src python probe_repeats.py MODEL_DIR [--let-go] [--keep-grads]

--let-go drops the loss after each repeat; with it, gradients are set to None too unless --keep-grads. Run under
GLIBC_TUNABLES as tunebench.core.startup.KEEP_FREED sets it, or without, to compare allocators."""

import argparse
import ctypes
import os
import time

import peft
import torch
from transformers import AutoModelForCausalLM

from tunebench.model import kernels
from tunebench.training.preference import token_logps


def status_mb(name: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(name))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--let-go", action="store_true")
    p.add_argument("--keep-grads", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                       target_modules=["q_proj", "v_proj"]))
    kernels.register()
    model.set_attn_implementation(kernels.NAME)
    model.train()
    ids = torch.randint(0, 49000, (4, 1024))
    index = torch.cat([torch.arange(r * 1023 + 700, r * 1023 + 1000) for r in range(4)])  # 300 loss positions a row
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    print("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES", "-"), "start RSS", status_mb("VmRSS"), "MB")
    for i in range(3):
        start = time.perf_counter()
        logps = token_logps(model, {"input_ids": ids}, index, None)
        (-logps.mean()).backward()
        if a.let_go:
            del logps
            if not a.keep_grads:
                model.zero_grad(set_to_none=True)
        print(f"repeat {i + 1}: {time.perf_counter() - start:.1f} s, VmHWM {status_mb('VmHWM'):,} MB, "
              f"VmRSS {status_mb('VmRSS'):,} MB", flush=True)


if __name__ == "__main__":
    main()
