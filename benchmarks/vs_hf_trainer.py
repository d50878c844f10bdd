"""tunebench vs HF Trainer + PEFT: real tokens/s, peak memory and eval loss, same machine, same run.

The peer is the reference study's recipe rebuilt with HF Trainer + PEFT: LoRA r=8, alpha=16,
dropout 0.1 on the attention projections (q_proj/v_proj; GPT-2's fused c_attn), micro batch 4 x
accumulation 2, max_length 128, padded to max_length, DataCollatorForLanguageModeling. tunebench
runs with its defaults (auto settings) at the same LoRA settings, effective batch 8 and max_length
128. Both train the same epochs on the same rows; both final adapters are scored by one evaluator
on the same held-out rows (loss on response tokens). Runs alternate tunebench / peer, each in its
own process, on the GPU when there is one (bf16 both), else on the CPU.

    python benchmarks/vs_hf_trainer.py                   # SmolLM2, Bitext sample (or built-in data)
    python benchmarks/vs_hf_trainer.py --repeats 2 --fp32-peer
    python benchmarks/vs_hf_trainer.py --sweep           # time/memory vs sequence length and micro batch
    # a GPU, GPT-2 124M (the study's model), then a GPU-sized setting: the peer at tunebench's probed
    # micro batch, padding to the longest row of its batch and grouping rows by length
    python benchmarks/vs_hf_trainer.py --model gpt2-124m --tokenizer ../shared/data/gpt2-tokenizer
    python benchmarks/vs_hf_trainer.py --model gpt2-124m --tokenizer ../shared/data/gpt2-tokenizer \
        --max-length 512 --effective-batch 64 --peer-micro same --peer-padding longest --samples 4514 --epochs 3
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
SHARED = Path(os.environ.get("TUNEBENCH_SHARED_DATA") or ROOT.parent / "shared" / "data")
BITEXT = SHARED / "bitext-early-official-4514rows" / "Bitext_Sample_Customer_Support_Training_Dataset.csv"
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1}  # on the model family's attention projections (auto)
LEARNING_RATES = {"lora": 2e-4, "full": 2e-5}  # both sides, per --method


def _common(args):
    """Model, tokenizer, tokenized data and the (train, eval) split both sides use."""
    import torch

    from tunebench.data.tokenize import load_tokenized, split
    from tunebench.model import models
    from tunebench.settings.finetune import DataConfig

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    loaded = models.resolve(args.model, args.tokenizer)
    cfg = DataConfig(path=args.data, max_length=args.max_length)
    data = load_tokenized(cfg, loaded.tokenizer, models.cache_dir())
    train_idx, eval_idx = split(len(data), 0.05, 42, args.samples)
    return loaded, data, train_idx, eval_idx


def _device(args) -> str:
    import torch

    return args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def _eval_loss(model, data, eval_idx, pad_id, device):
    import torch

    from tunebench.data import batching
    from tunebench.training.objective import CausalLMLoss, evaluate

    return evaluate(CausalLMLoss(model), batching.eval_batches(data, eval_idx, 8, pad_id),
                    torch.device(device))["eval_loss"]


def _gpu_peak_mb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def worker_peer(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from tunebench.model import methods
    device = _device(args)
    loaded, data, train_idx, eval_idx = _common(args)
    tok = loaded.tokenizer
    # The study's preprocessing: the whole text, padded to max_length; the collator masks padding.
    # --peer-padding longest leaves rows unpadded: the collator pads each batch to its longest row.
    rows = []
    for i in train_idx.tolist():
        ids = data.example(i)[0].tolist()
        pad = args.max_length - len(ids) if args.peer_padding == "max_length" else 0
        rows.append({"input_ids": ids + [tok.pad_token_id] * pad, "attention_mask": [1] * len(ids) + [0] * pad})
    if args.method == "full":  # every weight trained: the model as transformers loaded it (fp32, bf16 autocast)
        model = loaded.model
    else:
        modules, _ = methods.target_modules(loaded.model, "auto")
        model = get_peft_model(loaded.model, LoraConfig(task_type="CAUSAL_LM", target_modules=modules, **LORA))
    micro = args.peer_micro_batch
    accum = max(1, args.effective_batch // micro)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    batch_tokens: list[int] = []  # real tokens of each micro batch, in the order the Trainer takes them

    def collate(features):
        batch = collator(features)
        batch_tokens.append(int(batch["attention_mask"].sum()))
        return batch

    clock = harness.step_clock(on_begin=batch_tokens.clear)  # an OOM retry (--peer-micro auto) starts them again
    fields = TrainingArguments.__dataclass_fields__
    grouping = {"train_sampling_strategy": "group_by_length"} if args.peer_padding == "longest" and \
        "train_sampling_strategy" in fields else {}
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_train_epochs=args.epochs, learning_rate=LEARNING_RATES[args.method], warmup_steps=0.03,
        lr_scheduler_type="cosine", auto_find_batch_size=args.peer_find_batch,
        logging_steps=1000, save_strategy="no", report_to=[], bf16=args.peer_precision == "bf16",
        use_cpu=device == "cpu", dataloader_num_workers=0, seed=42, disable_tqdm=True, **grouping,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate, callbacks=[clock])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    micro = trainer._train_batch_size  # halved on each OOM when auto_find_batch_size found one
    steps = len(clock.marks)
    skip = 2  # warm-up steps excluded, as tunebench does
    measured_tokens = sum(batch_tokens[skip * accum:])  # the loader may run one batch ahead: a batch at most
    measured_time = clock.marks[-1] - clock.marks[skip - 1]
    gpu_peak = _gpu_peak_mb(device)
    model.eval()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=args.peer_precision == "bf16"):
        eval_loss = _eval_loss(model, data, eval_idx, tok.pad_token_id, device)
    return {"side": f"HF Trainer+PEFT ({args.peer_precision})", "steps": steps, "duration_s": wall,
            "tokens_per_s": measured_tokens / measured_time, "eval_loss": eval_loss, "peak_memory_mb": harness.peak_mb(),
            "gpu_peak_memory_mb": gpu_peak, "micro_batch_size": micro, "grad_accum_steps": accum,
            "padding": args.peer_padding, "grouping": bool(grouping)}


def worker_tunebench(args) -> dict:
    harness.as_the_command()
    from tunebench.jobs import finetune
    from tunebench.settings.finetune import load_config

    out = tempfile.mkdtemp()
    cfg = load_config(options={
        "model.name": args.model, "model.tokenizer": args.tokenizer, "data.path": args.data,
        "data.max_length": args.max_length, "data.max_samples": args.samples, "train.output_dir": out,
        "train.progress": False, "train.device": _device(args), "train.epochs": args.epochs,
        "adapter.r": LORA["r"], "adapter.lora_alpha": LORA["lora_alpha"], "adapter.lora_dropout": LORA["lora_dropout"],
        "adapter.target_modules": "auto", "train.effective_batch_size": args.effective_batch,
        "hardware.measure": args.measure, "hardware.precision": args.precision, "adapter.method": args.method,
        "train.learning_rate": LEARNING_RATES[args.method],
    })
    s = finetune.run(cfg)
    chosen = {d["setting"]: d["value"] for d in json.loads((Path(out) / "plan.json").read_text())["decisions"]}
    return {"side": "tunebench (auto)", "steps": s["steps"], "duration_s": s["duration_s"],
            "tokens_per_s": s["tokens_per_s"], "eval_loss": s["eval_loss"], "peak_memory_mb": harness.peak_mb(),
            "gpu_peak_memory_mb": s["peak_memory_mb"] if s["device"] == "cuda" else None,
            "mfu": s["mfu"], "peak_tflops_source": s["peak_tflops_source"], "device": s["device"],
            "micro_batch_size": s["micro_batch_size"], "grad_accum_steps": s["grad_accum_steps"],
            "measure_s": s["measure_s"], "memory_plan_mb": s["memory_plan_mb"], "loop_peak_mb": s["peak_memory_mb"],
            "chosen": {k: chosen.get(k) for k in ("micro_batch_size", "attention", "compile", "batch layout",
                                                  "target_modules", "precision")}}


def worker_sweep(args) -> dict:
    """A few optimizer-free steps at one (side, max_length, micro batch), on the CPU or the GPU: seconds per
    step and peak memory; with --trace, one more step under torch.profiler, written as a Chrome trace."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    from tunebench.model import methods, models
    from tunebench.settings.finetune import AdapterConfig
    from tunebench.training.objective import loss_sum, prepare

    device = torch.device(_device(args))
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    bf16 = args.sweep_precision == "bf16"
    loaded = models.resolve(args.model, args.tokenizer)
    modules, _ = methods.target_modules(loaded.model, "auto")
    vocab = min(40000, loaded.model.config.vocab_size)
    ids = torch.randint(min(10, vocab - 1), vocab, (args.micro_batch, args.max_length),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if args.side == "peer":
        model = get_peft_model(loaded.model.to(device), LoraConfig(task_type="CAUSAL_LM", target_modules=modules,
                                                                   **LORA))
        model.train()
        on_device = {k: v.to(device) for k, v in batch.items()}

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                model(**on_device).loss.backward()
    else:
        from tunebench.training import autotune
        from tunebench.training.autotune import attention

        base = loaded.model.to(device, torch.bfloat16 if bf16 else torch.float32)
        model = methods.add_adapter(base, AdapterConfig(r=LORA["r"], lora_alpha=LORA["lora_alpha"],
                                                        lora_dropout=LORA["lora_dropout"]), modules)
        model.train()
        b, n, _ = prepare(batch, device)

        def step():
            (loss_sum(model, b, None) / n).backward()

        def measure():
            t0 = time.perf_counter()
            step()
            harness.sync(device)
            return ids.numel() / (time.perf_counter() - t0)

        # The kernel probe runs in a process of its own (--steps 0) and is read back from the cache
        # here, so that its O(T^2) kernels do not set this process's peak memory.
        shape = autotune.Shape(args.model, "lora", "none", LORA["r"], ",".join(modules), args.max_length,
                           f"sweep, micro batch {args.micro_batch}", args.sweep_precision, torch.__version__, "auto",
                           "off", "off")
        row = attention.pick(model, "auto", measure, shape,
                             attention.fit(model, args.micro_batch, args.max_length, args.sweep_precision, device))
        if args.steps == 0:
            return {"attention": row[1]}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _i in range(args.steps):
        t0 = time.perf_counter()
        step()
        harness.sync(device)
        times.append(time.perf_counter() - t0)
    if args.trace:
        trace(step, device, f"{args.trace}-{args.side}")
    from tunebench.machine import hardware, metrics
    from tunebench.machine.metrics import training_flops_per_token

    matmul, layers, width = metrics.flop_dims(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peak, _ = hardware.peak_tflops(device.type, args.sweep_precision, hardware.detect(), threads,
                                   models.cache_dir() / "peak_flops.json")
    s_per_step = float(np.median(times[1:]))
    tokens_per_s = ids.numel() / s_per_step
    fpt = training_flops_per_token(matmul, trainable, layers, width, args.max_length, full=False)
    return {"side": args.side, "max_length": args.max_length, "micro_batch": args.micro_batch,
            "s_per_step": s_per_step, "tokens_per_s": tokens_per_s, "mfu": fpt * tokens_per_s / (peak * 1e12),
            "peak_memory_mb": _gpu_peak_mb(device.type) or harness.peak_mb(),
            "attention": "sdpa" if args.side == "peer" else row[1]}


def trace(step, device, stem: str) -> None:
    """One more `step` under torch.profiler: STEM.json.gz (a Chrome trace, for chrome://tracing or Perfetto;
    torch gzips it for the suffix) and STEM.txt (the 25 costliest operators, by GPU time on a GPU, else CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        harness.sync(device)
    prof.export_chrome_trace(f"{stem}.json.gz")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    Path(f"{stem}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default=str(BITEXT) if BITEXT.exists() else "builtin:customer-support")
    p.add_argument("--samples", type=int, default=1600,
                   help="rows used (95%% train, 5%% eval); the default makes a run of a few minutes, long "
                        "enough for tunebench's compile decision to be measured rather than skipped")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (gpt2-124m where SmolLM2's is absent)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: the GPU when present")
    p.add_argument("--effective-batch", type=int, default=8)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--peer-micro", default="4",
                   help="the peer's micro batch (accumulation makes up the effective batch); 'same': tunebench's "
                        "probed micro batch of the same repeat; 'auto': start there, HF's auto_find_batch_size "
                        "halving it on each CUDA OOM (accumulation kept, as HF keeps it)")
    p.add_argument("--method", default="lora", choices=["lora", "full"],
                   help="both sides: LoRA (r=8 on the attention projections, lr 2e-4) or full fine-tuning (lr 2e-5)")
    p.add_argument("--peer-padding", default="max_length", choices=["max_length", "longest"],
                   help="max_length: the study's; longest: pad each batch to its longest row, grouped by length")
    p.add_argument("--save", default=None, help="write every run's raw result and the medians to this JSON file")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fp32-peer", action="store_true", help="also run the study's fp32 recipe")
    p.add_argument("--peers", default=None, metavar="PRECISIONS",
                   help="the peer's precisions, e.g. fp32 on a CPU without native bf16 (default bf16; with "
                        "--fp32-peer bf16,fp32)")
    p.add_argument("--sweep", action="store_true", help="time and memory vs max_length and micro batch")
    p.add_argument("--sweep-models", default=None, help="models the sweep runs, comma-separated (default --model)")
    p.add_argument("--sweep-lengths", default="128,512,2048")
    p.add_argument("--sweep-micros", default="1,4")
    p.add_argument("--trace", default=None, metavar="STEM",
                   help="with --sweep: profile one more step of each side to STEM-SIDE.json.gz and STEM-SIDE.txt")
    p.add_argument("--measure", default="bounded", choices=["bounded", "full"],
                   help="tunebench's --measure: bounded (default) or full (every kernel and micro batch)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="tunebench's --precision (auto: what it picks here; fp32 stands in for a CPU without bf16)")
    p.add_argument("--check-args", action="store_true", help=argparse.SUPPRESS)  # gpu_session.sh --dry-run
    p.add_argument("--sweep-precision", default="bf16", choices=["bf16", "fp32"],
                   help="both sides' precision (fp32 on a CPU without native bf16)")
    p.add_argument("--worker", choices=["peer", "tunebench", "sweep"], help=argparse.SUPPRESS)
    p.add_argument("--peer-precision", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--peer-micro-batch", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--peer-find-batch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check_args:
        harness.check_imports(__file__)
        return
    if args.worker:
        result = {"peer": worker_peer, "tunebench": worker_tunebench, "sweep": worker_sweep}[args.worker](args)
        Path(args.result).write_text(json.dumps(result))
        return

    common = ["--model", args.model, "--data", args.data, "--samples", str(args.samples),
              "--max-length", str(args.max_length), "--device", args.device, "--epochs", str(args.epochs),
              "--effective-batch", str(args.effective_batch), "--peer-padding", args.peer_padding,
              "--measure", args.measure, "--precision", args.precision, "--method", args.method,
              *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
    if args.sweep:
        print(f"{'model':>22} {'max_length':>10} {'micro':>5} {'side':>10} {'attention':>10} {'s/step':>8} "
              f"{'tok/s':>8} {'MFU':>6} {'peak MB':>8}  ({args.sweep_precision})", flush=True)
        rows = []
        from tunebench.core.errors import TunebenchError
        from tunebench.model import inference

        for model in (args.sweep_models or args.model).split(","):
            for length in (int(n) for n in args.sweep_lengths.split(",")):
                try:
                    inference.check_length(model, length)
                except TunebenchError as e:
                    print(f"{model:>22} {length:>10} skipped: {e}", flush=True)
                    continue
                for micro in (int(n) for n in args.sweep_micros.split(",")):
                    pair = {}
                    for side in ("peer", "tunebench"):
                        argv = ["--worker", "sweep", "--side", side, "--max-length", str(length),
                                "--micro-batch", str(micro), "--model", model,
                                "--sweep-precision", args.sweep_precision, "--device", args.device,
                                *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
                                *(["--trace", f"{args.trace}-{model.replace('/', '_')}-{length}-{micro}"]
                                  if args.trace else [])]
                        if side == "tunebench":
                            harness.spawn(__file__, [*argv, "--steps", "0"])
                        r = pair[side] = harness.spawn(__file__, argv)
                        print(f"{model:>22} {length:>10} {micro:>5} {side:>10} {r['attention']:>10} "
                              f"{r['s_per_step']:8.2f} {r['tokens_per_s']:8.0f} {100 * r['mfu']:5.1f}% "
                              f"{r['peak_memory_mb']:8.0f}", flush=True)
                    rows.append({"model": model, **pair})
        if args.save:
            Path(args.save).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
        return

    import torch

    where = torch.cuda.get_device_name(0) if _device(args) == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"model {args.model}, {args.method}, data {args.data}, {args.samples} rows, max_length {args.max_length}, "
          f"effective batch {args.effective_batch}, {args.epochs:g} epoch(s), on {where}; runs alternate, each in its "
          "own process")
    runs: dict[str, list[dict]] = {}
    peers = args.peers.split(",") if args.peers else ["bf16"] + (["fp32"] if args.fp32_peer else [])
    plan = [("tunebench", None)] + [("peer", precision) for precision in peers]
    for rep in range(args.repeats):
        for worker, precision in plan:
            extra = ["--peer-precision", precision] if precision else []
            if worker == "peer":
                micro = runs["tunebench (auto)"][-1]["micro_batch_size"] if args.peer_micro in ("same", "auto") \
                    else int(args.peer_micro)
                extra += ["--peer-micro-batch", str(micro), *(["--peer-find-batch"] if args.peer_micro == "auto" else [])]
            r = harness.spawn(__file__, ["--worker", worker, *extra, *common])
            runs.setdefault(r["side"], []).append(r)
            gpu = f"  GPU peak {r['gpu_peak_memory_mb']:.0f} MB" if r.get("gpu_peak_memory_mb") else ""
            print(f"  run {rep + 1}: {r['side']:<28} {r['tokens_per_s']:8.0f} real tokens/s  "
                  f"eval loss {r['eval_loss']:.4f}  peak RSS {r['peak_memory_mb']:.0f} MB{gpu}  "
                  f"micro {r['micro_batch_size']} x {r['grad_accum_steps']}  "
                  f"train {r['duration_s']:.0f} s, process {r['total_s']:.0f} s"
                  + (f"  {r['chosen']}" if "chosen" in r else ""))
    keys = ("tokens_per_s", "eval_loss", "peak_memory_mb", "total_s", "gpu_peak_memory_mb")
    med = {side: {k: statistics.median(r[k] for r in rs) if rs[0].get(k) is not None else None for k in keys}
           for side, rs in runs.items()}
    tb_runs = runs["tunebench (auto)"]
    tb = med["tunebench (auto)"]
    mfus = [r["mfu"] for r in tb_runs if r.get("mfu") is not None]
    tb["mfu"] = statistics.median(mfus) if mfus else None
    print("\nmedians")
    for side, m in med.items():
        # The same model and real tokens: the peer's MFU is tunebench's scaled by the tokens/s ratio.
        if side != "tunebench (auto)" and tb["mfu"] is not None:
            m["mfu"] = tb["mfu"] * m["tokens_per_s"] / tb["tokens_per_s"]
        mfu = f"  MFU {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else ""
        gpu = f"  GPU peak {m['gpu_peak_memory_mb']:.0f} MB" if m["gpu_peak_memory_mb"] else ""
        print(f"  {side:<28} {m['tokens_per_s']:8.0f} tok/s{mfu}  eval loss {m['eval_loss']:.4f}  "
              f"peak RSS {m['peak_memory_mb']:.0f} MB{gpu}  process {m['total_s']:.0f} s")
    if tb["mfu"] is not None:
        print(f"  MFU against {tb_runs[0]['peak_tflops_source']}")
    for side, m in med.items():
        if side == "tunebench (auto)":
            continue
        ratio = tb["tokens_per_s"] / m["tokens_per_s"]
        loss_gap = (tb["eval_loss"] - m["eval_loss"]) / m["eval_loss"]
        memory = f"; GPU memory {tb['gpu_peak_memory_mb'] / m['gpu_peak_memory_mb']:.2f}x" \
            if tb["gpu_peak_memory_mb"] and m["gpu_peak_memory_mb"] else ""
        print(f"ratio vs {side}: {ratio:.2f}x real tokens/s{memory}; eval loss {100 * loss_gap:+.1f}% "
              f"({'within' if loss_gap <= 0.02 else 'NOT within'} 2%)")
    if args.save:
        Path(args.save).write_text(json.dumps({"args": vars(args), "device": where, "runs": runs, "medians": med},
                                              indent=1, default=str))


if __name__ == "__main__":
    main()
