"""tunebench vs HF Trainer + PEFT: real tokens/s, peak memory and eval loss, same machine, same run.

The peer is the reference study's recipe rebuilt with HF Trainer + PEFT: LoRA r=8, alpha=16,
dropout 0.1 on q_proj/v_proj, micro batch 4 x accumulation 2, max_length 128, padded to
max_length, DataCollatorForLanguageModeling. tunebench runs with its defaults (auto settings)
at the same LoRA settings, effective batch 8 and max_length 128. Both train one epoch on the
same rows; both final adapters are scored by one evaluator on the same held-out rows (loss on
response tokens). Runs alternate peer / tunebench, each in its own process.

    python benchmarks/vs_hf_trainer.py                   # SmolLM2, Bitext sample (or built-in data)
    python benchmarks/vs_hf_trainer.py --repeats 2 --fp32-peer
    python benchmarks/vs_hf_trainer.py --sweep           # time/memory vs sequence length and micro batch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: run as a script, this directory is on the path

ROOT = Path(__file__).resolve().parents[1]
BITEXT = ROOT.parent / "shared" / "data" / "bitext-early-official-4514rows" / \
    "Bitext_Sample_Customer_Support_Training_Dataset.csv"
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


def _common(args):
    """Model, tokenizer, tokenized data and the (train, eval) split both sides use."""
    import torch

    from tunebench import models
    from tunebench.config import DataConfig
    from tunebench.data.tokenize import load_tokenized, split

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    loaded = models.resolve(args.model)
    cfg = DataConfig(path=args.data, max_length=args.max_length)
    data = load_tokenized(cfg, loaded.tokenizer, models.cache_dir())
    train_idx, eval_idx = split(len(data), 0.05, 42, args.samples)
    return loaded, data, train_idx, eval_idx


def _eval_loss(model, data, eval_idx, pad_id):
    import torch

    from tunebench.data import batching
    from tunebench.loop import CausalLMLoss, evaluate

    return evaluate(CausalLMLoss(model), batching.eval_batches(data, eval_idx, 8, pad_id),
                    torch.device("cpu"))["eval_loss"]


def worker_peer(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    loaded, data, train_idx, eval_idx = _common(args)
    tok = loaded.tokenizer
    # The study's preprocessing: the whole text, padded to max_length; the collator masks padding.
    rows = []
    for i in train_idx.tolist():
        ids = data.example(i)[0].tolist()
        rows.append({"input_ids": ids + [tok.pad_token_id] * (args.max_length - len(ids)),
                     "attention_mask": [1] * len(ids) + [0] * (args.max_length - len(ids))})
    real_tokens = [sum(r["attention_mask"]) for r in rows]
    model = get_peft_model(loaded.model, LoraConfig(task_type="CAUSAL_LM", **LORA))

    clock = harness.step_clock()
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=1, learning_rate=2e-4, warmup_steps=0.03, lr_scheduler_type="cosine",
        logging_steps=1000, save_strategy="no", report_to=[], bf16=args.peer_precision == "bf16",
        use_cpu=True, dataloader_num_workers=0, seed=42, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=rows,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    steps = len(clock.marks)
    skip = 2  # warm-up steps excluded, as tunebench does
    per_step = 8
    measured_tokens = sum(real_tokens[(skip * per_step):])
    measured_time = clock.marks[-1] - clock.marks[skip - 1]
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.peer_precision == "bf16"):
        eval_loss = _eval_loss(model, data, eval_idx, tok.pad_token_id)
    return {"side": f"HF Trainer+PEFT ({args.peer_precision})", "steps": steps, "duration_s": wall,
            "tokens_per_s": measured_tokens / measured_time, "eval_loss": eval_loss, "peak_memory_mb": harness.peak_mb()}


def worker_tunebench(args) -> dict:
    from tunebench.config import load_config
    from tunebench.jobs import finetune

    out = tempfile.mkdtemp()
    cfg = load_config(options={
        "model.name": args.model, "data.path": args.data, "data.max_length": args.max_length,
        "data.max_samples": args.samples, "train.output_dir": out, "train.progress": False,
        "adapter.r": LORA["r"], "adapter.lora_alpha": LORA["lora_alpha"], "adapter.lora_dropout": LORA["lora_dropout"],
        "adapter.target_modules": ",".join(LORA["target_modules"]), "train.effective_batch_size": 8,
    })
    s = finetune.run(cfg)
    chosen = {d["setting"]: d["value"] for d in json.loads((Path(out) / "plan.json").read_text())["decisions"]}
    return {"side": "tunebench (auto)", "steps": s["steps"], "duration_s": s["duration_s"],
            "tokens_per_s": s["tokens_per_s"], "eval_loss": s["eval_loss"], "peak_memory_mb": harness.peak_mb(),
            "mfu": s["mfu"], "chosen": {k: chosen.get(k) for k in ("micro_batch_size", "attention", "compile",
                                                                    "batch layout")}}


def worker_sweep(args) -> dict:
    """A few optimizer-free steps at one (side, max_length, micro batch): seconds per step and peak memory."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    from tunebench import models
    from tunebench.loop import loss_sum, prepare

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    loaded = models.resolve(args.model)
    ids = torch.randint(10, 40000, (args.micro_batch, args.max_length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if args.side == "peer":
        model = get_peft_model(loaded.model, LoraConfig(task_type="CAUSAL_LM", **LORA))
        model.train()

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(**batch).loss.backward()
    else:
        from tunebench import tune
        from tunebench.tune import attention

        base = loaded.model.to(torch.bfloat16)
        model = models.add_lora(base, LORA["r"], LORA["lora_alpha"], LORA["lora_dropout"], LORA["target_modules"])
        model.train()
        b, n, _ = prepare(batch, torch.device("cpu"))

        def step():
            (loss_sum(model, b, None) / n).backward()

        def measure():
            t0 = time.perf_counter()
            step()
            return ids.numel() / (time.perf_counter() - t0)

        # The kernel probe runs in a process of its own (--steps 0) and is read back from the cache
        # here, so that its O(T^2) kernels do not set this process's peak memory.
        shape = tune.Shape(args.model, "lora", "none", LORA["r"], ",".join(LORA["target_modules"]), args.max_length,
                           f"sweep, micro batch {args.micro_batch}", "bf16", torch.__version__, "auto", "off", "off")
        row = attention.pick(model, "auto", measure, shape,
                             attention.fit(model, args.micro_batch, args.max_length, "bf16", torch.device("cpu")))
        if args.steps == 0:
            return {"attention": row[1]}
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"side": args.side, "max_length": args.max_length, "micro_batch": args.micro_batch,
            "s_per_step": float(np.median(times[1:])), "peak_memory_mb": harness.peak_mb(),
            "attention": "sdpa" if args.side == "peer" else row[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default=str(BITEXT) if BITEXT.exists() else "builtin:customer-support")
    p.add_argument("--samples", type=int, default=1600,
                   help="rows used (95%% train, 5%% eval); the default makes a run of a few minutes, long "
                        "enough for tunebench's compile decision to be measured rather than skipped")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fp32-peer", action="store_true", help="also run the study's fp32 recipe")
    p.add_argument("--sweep", action="store_true", help="time and memory vs max_length and micro batch")
    p.add_argument("--worker", choices=["peer", "tunebench", "sweep"], help=argparse.SUPPRESS)
    p.add_argument("--peer-precision", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        result = {"peer": worker_peer, "tunebench": worker_tunebench, "sweep": worker_sweep}[args.worker](args)
        Path(args.result).write_text(json.dumps(result))
        return

    common = ["--model", args.model, "--data", args.data, "--samples", str(args.samples),
              "--max-length", str(args.max_length)]
    if args.sweep:
        print(f"{'max_length':>10} {'micro':>5} {'side':>10} {'attention':>10} {'s/step':>8} {'tok/s':>8} "
              f"{'peak MB':>8}")
        for length in (128, 512, 2048):
            for micro in (1, 4):
                for side in ("peer", "tunebench"):
                    argv = ["--worker", "sweep", "--side", side, "--max-length", str(length),
                            "--micro-batch", str(micro), "--model", args.model]
                    if side == "tunebench":
                        harness.spawn(__file__, [*argv, "--steps", "0"])
                    r = harness.spawn(__file__, argv)
                    print(f"{length:>10} {micro:>5} {side:>10} {r['attention']:>10} {r['s_per_step']:8.2f} "
                          f"{length * micro / r['s_per_step']:8.0f} {r['peak_memory_mb']:8.0f}")
        return

    print(f"model {args.model}, data {args.data}, {args.samples} rows, max_length {args.max_length}, "
          f"{os.cpu_count()} CPUs; runs alternate, each in its own process")
    runs: dict[str, list[dict]] = {}
    plan = [("peer", "bf16"), ("tunebench", None)] + ([("peer", "fp32")] if args.fp32_peer else [])
    for rep in range(args.repeats):
        for worker, precision in plan:
            extra = ["--peer-precision", precision] if precision else []
            r = harness.spawn(__file__, ["--worker", worker, *extra, *common])
            runs.setdefault(r["side"], []).append(r)
            print(f"  run {rep + 1}: {r['side']:<28} {r['tokens_per_s']:8.0f} real tokens/s  "
                  f"eval loss {r['eval_loss']:.4f}  peak {r['peak_memory_mb']:.0f} MB  "
                  f"train {r['duration_s']:.0f} s, process {r['total_s']:.0f} s"
                  + (f"  {r['chosen']}" if "chosen" in r else ""))
    keys = ("tokens_per_s", "eval_loss", "peak_memory_mb", "total_s")
    med = {side: {k: statistics.median(r[k] for r in rs) for k in keys} for side, rs in runs.items()}
    tb = med["tunebench (auto)"]
    print("\nmedians")
    for side, m in med.items():
        print(f"  {side:<28} {m['tokens_per_s']:8.0f} tok/s  eval loss {m['eval_loss']:.4f}  "
              f"peak {m['peak_memory_mb']:.0f} MB  process {m['total_s']:.0f} s")
    mfu = statistics.median(r["mfu"] for r in runs["tunebench (auto)"] if r.get("mfu") is not None)
    print(f"  tunebench MFU {100 * mfu:.1f}% (of this CPU's measured matmul peak)")
    for side, m in med.items():
        if side == "tunebench (auto)":
            continue
        ratio = tb["tokens_per_s"] / m["tokens_per_s"]
        loss_gap = (tb["eval_loss"] - m["eval_loss"]) / m["eval_loss"]
        print(f"ratio vs {side}: {ratio:.2f}x real tokens/s; eval loss {100 * loss_gap:+.1f}% "
              f"({'within' if loss_gap <= 0.02 else 'NOT within'} 2%)")


if __name__ == "__main__":
    main()
