"""What one prefill (a turn's first forward, no gradient, the last position's logits) adds to the resident memory,
for the towns start as sampling runs it (bf16, decoding's eager attention) and with PEFT's LoRA on q_proj, v_proj
(fp32 adapters), with and without bf16 autocast. The heap is trimmed before each, RSS read every 1 ms. Run by hand
from the repository root, alone, with the towns benchmark's seed 0 kept in /work/arms:

    GLIBC_TUNABLES=<tunebench's KEEP_FREED> python prefill.py {base,lora} {plain,autocast} [head]

`head`: inside decoding.whole_rows_to_head, as decoding runs since 2026-12-04 (the fix this found)."""

import contextlib
import ctypes
import sys
import threading
import time

import psutil
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, DynamicCache

from tunebench.model import decoding

proc, peak, stop = psutil.Process(), [0.0], threading.Event()


def rss() -> float:
    return proc.memory_info().rss / 2**20


def watch() -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)


def once(model, rows: int, width: int, autocast: bool) -> None:
    ctypes.CDLL(None).malloc_trim(0)
    time.sleep(0.05)
    before = peak[0] = rss()
    ids = torch.randint(0, 49000, (rows, width))
    mask = torch.ones_like(ids)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), cast, decoding.eager_attention(model, ids.device):
        with decoding.whole_rows_to_head(model) if sys.argv[3:] == ["head"] else contextlib.nullcontext():
            model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1, cache=DynamicCache(),
                  use_cache=True, logits_to_keep=1)
    time.sleep(0.02)
    print(f"{rows:3d} x {width:4d}: peak +{peak[0] - before:5.0f} MB over {before:5.0f}", flush=True)


def main() -> None:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained("/work/arms/seed0/start", dtype=torch.bfloat16)
    if sys.argv[1] == "lora":
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        for w in model.parameters():
            if w.requires_grad:
                w.data = w.data.float()
    model.eval()
    threading.Thread(target=watch, daemon=True).start()
    print(sys.argv[1:])
    for rows, width in ((4, 371), (4, 371), (4, 372), (16, 100), (16, 100)):
        once(model, rows, width, sys.argv[2] == "autocast")
    stop.set()


if __name__ == "__main__":
    main()
