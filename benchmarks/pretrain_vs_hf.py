"""tunebench pretrain vs HF Trainer: real tokens/s, MFU, peak memory and validation loss at equal steps.

Both sides build the same model from the same config (tunebench.model.arch, the same seed), train on the
same token blocks in the same order (HF Trainer gets them pre-ordered, no shuffling of its own), with
the same micro batch, schedule, learning rate, weight decay and precision (bf16 autocast, or fp32 on a
CPU without native bf16: --precision fp32), for the same number
of steps; both are scored by one evaluator on the same validation blocks. Runs alternate HF /
tunebench, each in its own process. The first two steps are warm-up on both sides.

    python benchmarks/pretrain_vs_hf.py                          # small and medium configs at max_length 512
    python benchmarks/pretrain_vs_hf.py --configs cpu_medium_model --steps 20 --repeats 2
    python benchmarks/pretrain_vs_hf.py --precision fp32                        # an AVX2 CPU: fp32 on both sides
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
SHARED = ROOT.parent / "shared" / "data"
CORPUS = [SHARED / "llamafactory-demo-data" / "wiki_demo.txt", SHARED / "tinyshakespeare" / "input.txt"]


def _cfg(args, out: str):
    """The run both sides make: the shipped config at this length, batch, step count and precision."""
    from tunebench.settings import pretrain as pretrain_config
    return pretrain_config.load(args.config, {
        "data.train_file": ",".join(map(str, args.data)), "data.max_length": args.max_length,
        "data.max_eval_blocks": args.eval_blocks, "training.batch_size": args.micro_batch,
        "training.gradient_accumulation_steps": 1, "training.max_steps": args.steps, "training.warmup_steps": 2,
        "training.eval_steps": None, "training.save_steps": None, "training.checkpoint_dir": out,
        "training.progress": False, "training.bf16": args.precision == "bf16", "training.logging_steps": 1,
        "training.compile": args.compile, "training.attention": args.attention, "training.monitor": False})


def _data(cfg):
    """Tokenizer, (train, validation) blocks and the first epoch's batch order, exactly as pretrain makes them."""
    from tunebench.data import batching, blocks
    from tunebench.jobs.parts import pretraining
    from tunebench.model import models

    tok, _ = pretraining.load_or_train_tokenizer(cfg)
    tokens = blocks.token_file(cfg.data_files, tok, models.cache_dir())
    train, val = blocks.split(blocks.cut(tokens, cfg.data.max_length), cfg.data.validation_split,
                              cfg.schedule.seed, cfg.data.split)
    val = val.subset(range(min(len(val), cfg.data.max_eval_blocks)))
    import numpy as np

    order = batching.epoch_order(np.arange(len(train)), cfg.batch.micro_batch_size, cfg.schedule.seed, 0)
    return tok, train, val, order


def _val_loss(model, val, micro: int, precision: str) -> float:
    import torch

    from tunebench.training.objective import CausalLMLoss, evaluate

    batches = [val.collate(range(i, min(i + 2 * micro, len(val)))) for i in range(0, len(val), 2 * micro)]
    return evaluate(CausalLMLoss(model, torch.bfloat16 if precision == "bf16" else None), batches, torch.device("cpu"))["eval_loss"]


def _flops(model, length: int) -> float:
    from tunebench.machine import metrics
    from tunebench.machine.metrics import training_flops_per_token

    matmul, layers, width = metrics.flop_dims(model)
    return training_flops_per_token(matmul, sum(p.numel() for p in model.parameters()), layers, width, length, True)


def worker_hf(args) -> dict:
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments, default_data_collator

    from tunebench.model import arch
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cfg = _cfg(args, tempfile.mkdtemp())
    tok, train, val, order = _data(cfg)
    b, o, s = cfg.batch, cfg.optimizer, cfg.schedule
    rows = [{k: v[0] for k, v in train.collate([i]).items()} for batch in order[: s.max_steps] for i in batch]
    model = arch.build(cfg.model, tok, s.seed)

    class InOrder(Trainer):  # the same batches in the same order as tunebench's first epoch
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    clock = harness.step_clock()
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=b.micro_batch_size, gradient_accumulation_steps=1,
        max_steps=s.max_steps, learning_rate=o.lr, weight_decay=o.weight_decay, warmup_steps=s.warmup_steps,
        lr_scheduler_type=s.schedule, max_grad_norm=o.max_grad_norm, logging_steps=1000, save_strategy="no",
        report_to=[], bf16=args.precision == "bf16", use_cpu=True, dataloader_num_workers=0, seed=s.seed, disable_tqdm=True)
    trainer = InOrder(model=model, args=targs, train_dataset=rows, data_collator=default_data_collator,
                      callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    skip = 2
    tokens = b.micro_batch_size * cfg.data.max_length * (len(clock.marks) - skip)
    model.eval()
    return {"side": "HF Trainer", "steps": len(clock.marks), "duration_s": wall,
            "tokens_per_s": tokens / (clock.marks[-1] - clock.marks[skip - 1]),
            "val_loss": _val_loss(model, val, b.micro_batch_size, args.precision), "flops_per_token": _flops(model, cfg.data.max_length),
            "peak_memory_mb": harness.peak_mb(), "parameters": sum(p.numel() for p in model.parameters())}


def worker_tunebench(args) -> dict:
    harness.as_the_command()
    from transformers import AutoModelForCausalLM

    from tunebench.jobs import pretrain

    out = tempfile.mkdtemp()
    cfg = _cfg(args, out)
    s = pretrain.run(cfg)
    _, _, val, _ = _data(cfg)
    model = AutoModelForCausalLM.from_pretrained(out)  # the saved model, scored by the same evaluator
    chosen = {d["setting"]: d["value"] for d in json.loads((Path(out) / "plan.json").read_text())["decisions"]}
    return {"side": "tunebench pretrain", "steps": s["steps"], "duration_s": s["duration_s"],
            "tokens_per_s": s["tokens_per_s"], "val_loss": _val_loss(model, val, cfg.batch.micro_batch_size, args.precision),
            "flops_per_token": s["flops_per_token"], "peak_memory_mb": harness.peak_mb(), "parameters": s["parameters"],
            "chosen": {k: chosen.get(k) for k in ("attention", "compile", "precision")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["cpu_small_model", "cpu_medium_model"])
    p.add_argument("--data", nargs="+", default=[str(c) for c in CORPUS if c.exists()])
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compile", default="off", help="tunebench's --compile (auto measures only runs over ~3 min)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="both sides' precision (default: bf16 where the CPU has native bf16, else fp32)")
    p.add_argument("--worker", choices=["hf", "tunebench"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.data:
        raise SystemExit("no corpus: pass --data FILE (the default reads ../shared/data)")
    if args.worker:
        result = {"hf": worker_hf, "tunebench": worker_tunebench}[args.worker](args)
        Path(args.result).write_text(json.dumps(result))
        return

    from tunebench.machine import hardware
    from tunebench.model import models
    hw = hardware.detect()
    args.precision = args.precision or ("bf16" if hw.cpu_bf16 else "fp32")
    peak, source = hardware.peak_tflops("cpu", args.precision, hw, len(os.sched_getaffinity(0)),
                                        models.cache_dir() / "peak_flops.json")
    print(f"{hw.cpu_model}, {len(os.sched_getaffinity(0))} threads, {args.precision} peak {peak:.3f} TFLOP/s ({source}); "
          f"max_length {args.max_length}, micro batch {args.micro_batch}, {args.steps} steps; alternating processes")
    for config in args.configs:
        common = ["--config", config, "--data", *args.data, "--max-length", str(args.max_length), "--micro-batch",
                  str(args.micro_batch), "--steps", str(args.steps), "--eval-blocks", str(args.eval_blocks),
                  "--compile", args.compile, "--attention", args.attention, "--precision", args.precision]
        runs: dict[str, list[dict]] = {}
        for rep in range(args.repeats):
            for worker in ("hf", "tunebench"):
                r = harness.spawn(__file__, ["--worker", worker, *common])
                runs.setdefault(r["side"], []).append(r)
                mfu = r["flops_per_token"] * r["tokens_per_s"] / (peak * 1e12)
                print(f"  {config} run {rep + 1}: {r['side']:<20} {r['tokens_per_s']:7.0f} tokens/s  MFU "
                      f"{100 * mfu:4.1f}%  val loss {r['val_loss']:.4f}  peak {r['peak_memory_mb']:6.0f} MB  "
                      f"process {r['total_s']:.0f} s" + (f"  {r['chosen']}" if "chosen" in r else ""))
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "val_loss", "peak_memory_mb")}
               for side, rs in runs.items()}
        tb, hf = med["tunebench pretrain"], med["HF Trainer"]
        fpt = runs["tunebench pretrain"][0]["flops_per_token"]
        print(f"{config} ({runs['tunebench pretrain'][0]['parameters']:,} parameters): "
              f"{tb['tokens_per_s'] / hf['tokens_per_s']:.2f}x HF Trainer's tokens/s "
              f"({tb['tokens_per_s']:.0f} vs {hf['tokens_per_s']:.0f}); MFU {100 * fpt * tb['tokens_per_s'] / peak / 1e12:.1f}% "
              f"vs {100 * fpt * hf['tokens_per_s'] / peak / 1e12:.1f}%; val loss at step {args.steps} "
              f"{tb['val_loss']:.4f} vs {hf['val_loss']:.4f}; peak {tb['peak_memory_mb']:.0f} vs "
              f"{hf['peak_memory_mb']:.0f} MB")


if __name__ == "__main__":
    main()
