"""The CUDA paths, run for real on a GPU: the precision and TF32 decisions, the batch probe backing off
from a real CUDA OOM (and to gradient checkpointing when one row does not fit), QLoRA 4-bit and 8-bit
steps, fp16 with a GradScaler, fused AdamW, eval and resumes that reproduce the losses (LoRA, full,
QLoRA, pretraining), every PEFT method, compile, packed rows with flash-attn and Liger, DPO, `eval`,
`generate` and `serve` placing the model on the GPU, `tunebench hw`, the GPU monitor, and `tunebench
compare` on the study's GPU configurations, resumed. Every test is marked `gpu` and skips where no CUDA
GPU is visible.

    python -m pytest -m gpu tests/test_gpu.py
    TUNEBENCH_GPU_ARTIFACTS=DIR python -m pytest -m gpu tests/test_gpu.py   # also keep each run's records

GPT-2 124M runs need GPT-2's tokenizer from ../shared/data (or TUNEBENCH_SHARED_DATA) and skip without it;
QLoRA needs bitsandbytes, and Liger / flash-attn tests run only where those packages are installed.
"""

import contextlib
import csv
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SHARED, pairs_file, run_losses, run_weights, sigterm_after_step, tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.jobs import finetune
from tunebench.jobs.parts import finetune_model, runner
from tunebench.machine import hardware
from tunebench.training import checkpoint, optim

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]

GPT2_TOKENIZER = SHARED / "gpt2-tokenizer"
RECORDS = ("plan.json", "summary.json", "monitor.jsonl", "metrics.jsonl", "results.csv")


@pytest.fixture(autouse=True)
def keep_records(request, tmp_path):
    """With TUNEBENCH_GPU_ARTIFACTS set (benchmarks/gpu_session.sh sets it), each test's run records
    (plan.json, summary.json, monitor.jsonl, metrics.jsonl, results.csv) are copied there, under the
    test's name, so every GPU figure can be traced to a file."""
    yield
    target = os.environ.get("TUNEBENCH_GPU_ARTIFACTS")
    if not target:
        return
    for path in tmp_path.rglob("*"):
        if path.name in RECORDS and "checkpoints" not in path.parts:
            dest = Path(target) / request.node.name / path.relative_to(tmp_path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


@pytest.fixture
def gpt2_tokenizer() -> str:
    if not (GPT2_TOKENIZER / "vocab.json").is_file():
        pytest.skip(f"GPT-2's tokenizer is not at {GPT2_TOKENIZER}: point TUNEBENCH_SHARED_DATA at shared/data")
    return str(GPT2_TOKENIZER)


def cuda_config(data, out, model="tiny", tokenizer=None, **extra):
    """tiny_run_config on the GPU (6 steps of micro 2 x accumulation 2), compile off unless asked, in the
    precision the GPU picks (bf16 on Ampere and newer, fp16 before: the same on every GPU of a kind) unless the
    test names one; tiny_run_config's fp32 is for CPUs, whose pick varies. The loss is logged every step: on
    a GPU the run's own choice is every 10 (reading a loss makes the host wait), and the tests read each step."""
    options = {"train.device": "cuda", "train.compile": "off", "model.name": model, "train.precision": "auto",
               "logging.logging_steps": 1}
    if tokenizer:
        options["model.tokenizer"] = tokenizer
    if model != "tiny":
        options["train.lr"] = 1e-3
    return tiny_run_config(data, out, **{**options, **extra})


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _plan(out):
    return {d["setting"]: (d["value"], d["reason"]) for d in json.loads((out / "plan.json").read_text())["decisions"]}


def test_plan_picks_bf16_and_tf32_on_ampere_or_newer_with_reasons():
    hw = hardware.detect()
    gpu = hw.gpus[0]
    plan = hardware.plan("auto", "auto", hw)
    assert plan.device == "cuda" and gpu.name in plan.decision("device").reason
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        runner.apply_plan(plan)
        if gpu.capability >= (8, 0):
            assert plan.precision == "bf16" and "bf16 tensor cores" in plan.decision("precision").reason
            assert plan.value("tf32") is True and "TF32" in plan.decision("tf32").reason
            assert torch.backends.cuda.matmul.allow_tf32 is True
        else:
            assert plan.precision == "fp16" and "GradScaler" in plan.decision("precision").reason
            assert plan.value("tf32") is False
        assert plan.value("pin_memory") is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_hw_names_the_gpu_its_memory_capability_and_datasheet_peak():
    out = subprocess.run([sys.executable, "-m", "tunebench", "hw"], capture_output=True, text=True, check=True).stdout
    props = torch.cuda.get_device_properties(0)
    assert props.name in out
    assert f"{props.total_memory // 2**20 / 1024:.1f} GiB" in out
    assert f"sm_{props.major}{props.minor}" in out
    precision = "bf16" if props.major >= 8 else "fp16"
    peak = hardware.gpu_peak_tflops(props.name, precision)
    if peak is None:
        assert "is not in the peak table" in out
    else:
        assert f"{peak:.2f} TFLOP/s ({props.name} {precision} datasheet peak)" in out


def test_fused_adamw_runs_on_the_gpu():
    model = torch.nn.Linear(64, 64).cuda()
    opt = optim.adamw(model, 1e-2, 0.01, torch.device("cuda"))
    assert opt.defaults["fused"] is True
    before = model.weight.detach().clone()
    model(torch.randn(8, 64, device="cuda")).square().mean().backward()
    opt.step()
    assert not torch.equal(before, model.weight)
    assert opt.state[model.weight]["exp_avg"].is_cuda


RESUME_CASES = {
    "tiny-lora-bf16": ("tiny", {}),
    "gpt2-lora-bf16": ("gpt2-124m", {}),
    "tiny-full-fp16": ("tiny", {"adapter.method": "full", "train.precision": "fp16", "train.lr": 1e-3}),
    "gpt2-full-bf16": ("gpt2-124m", {"adapter.method": "full", "train.lr": 1e-4}),
    "tiny-qlora-4bit": ("tiny", {"adapter.method": "qlora", "adapter.quantization": "4bit"}),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_train_eval_and_resume_after_sigterm_reproduce_the_run(tmp_path, dataset, request, case):
    """Killed at step 3 and resumed on the GPU, a run gives the uninterrupted run's losses: the CUDA RNG
    (dropout), the fused AdamW state and, under fp16, the GradScaler's scale come back from the checkpoint."""
    model, extra = RESUME_CASES[case]
    if extra.get("adapter.method") == "qlora":
        pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    tok = request.getfixturevalue("gpt2_tokenizer") if model == "gpt2-124m" else None
    straight = tmp_path / "straight"
    finetune.run(cuda_config(dataset, straight, model, tok, **extra))
    expected = run_losses(straight)
    s = _summary(straight)
    assert s["device"] == "cuda" and s["steps"] == 6
    assert s["precision"] == extra.get("train.precision", "bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert s["eval_loss"] is not None and s["eval_loss"] == s["eval_loss"]  # evaluated, and not NaN
    assert s["peak_memory_mb"] > 0
    if hardware.gpu_peak_tflops(torch.cuda.get_device_name(0), s["precision"]):
        assert 0 < s["mfu"] < 1
    assert _plan(straight)["optimizer"][0] == "AdamW, fused"

    part = tmp_path / "part"
    with sigterm_after_step(3), pytest.raises(TunebenchError, match="interrupted at step 3"):
        finetune.run(cuda_config(dataset, part, model, tok, **extra))
    [saved] = checkpoint.list_checkpoints(part / "checkpoints")
    blob = torch.load(saved / checkpoint.TENSORS, weights_only=False)
    assert blob["rng"][0]["cuda"]  # the GPU's dropout stream continues where it stopped
    if extra.get("train.precision") == "fp16":
        assert blob["scaler"] and blob["scaler"]["scale"] > 0
    else:
        assert blob["scaler"] is None
    finetune.run(cuda_config(dataset, part, model, tok, **extra, **{"train.resume": "auto"}))
    resumed = run_losses(part)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # the same kernels on the same inputs; atomics in a backward may round apart
        assert resumed[step] == pytest.approx(expected[step], rel=1e-3, abs=1e-4), step
    want, got = run_weights(straight), run_weights(part)
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-3)


@contextlib.contextmanager
def gpu_filled_but(headroom: int):
    """All of the GPU's free memory taken but `headroom` bytes, for the block (skipped when too little is free)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < headroom + 2**30:
        pytest.skip(f"only {free / 2**30:.1f} GiB free on the GPU")
    blocker = torch.empty(free - headroom, dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del blocker
        torch.cuda.empty_cache()


def _long_rows(path, n):
    """`n` rows whose responses fill any max_length up to 1,024 GPT-2 tokens."""
    path.write_text("".join(json.dumps({"instruction": f"question {i}", "response": " ".join(
        f"word{(i * 7 + j) % 997}" for j in range(600))}) + "\n" for i in range(n)))
    return path


def test_batch_probe_backs_off_from_a_real_cuda_oom_and_keeps_the_effective_batch(tmp_path, gpt2_tokenizer, capsys,
                                                                                   monkeypatch):
    """All but a few GiB of the GPU is taken, so the probe's larger micro batches hit a real CUDA OOM; it
    keeps the fastest size that ran, accumulation makes up the effective batch, and the run trains.
    The probe's budget is lifted: left alone, its prediction stops before the size that would not fit (on
    an H200 it skipped micro batch 8, predicted at 143,841 MB of 143,771: that path is tested on CPU), and
    this test is about the OOM itself."""
    from tunebench.training.autotune import batch

    monkeypatch.setattr(batch, "memory_budget_mb", lambda device, ranks_sharing=1: (
        torch.cuda.memory_allocated(device) / 2**20, float("inf")))
    data = _long_rows(tmp_path / "long.jsonl", 80)
    with gpu_filled_but(3 * 2**30):
        summary = finetune.run(cuda_config(data, tmp_path / "oom", "gpt2-124m", gpt2_tokenizer, **{
            "data.max_length": 512, "train.micro_batch_size": "auto", "train.effective_batch_size": 64,
            "train.max_steps": 2, "data.eval_fraction": 0.05,
            # every size until the OOM: a 2-step run's own sweep stops where measuring would cost more than it saves
            "hardware.measure": "full"}))
    printed = capsys.readouterr().out
    probe_table = printed[printed.index("batch-size probe"):]
    assert " oom" in probe_table, probe_table
    micro = summary["micro_batch_size"]
    # the pick is the fastest size that ran, from the probe's own rows, and it is below the first that hit the OOM
    rows = [line.split() for line in probe_table.splitlines()[1:] if line.split()[:1] and line.split()[0].isdigit()]
    ran = {int(r[0]): float(r[1].replace(",", "")) for r in rows if r[3] == "ok"}  # micro, tokens/s, MB, status
    oom = min(int(r[0]) for r in rows if r[3] == "oom")
    assert micro == max(ran, key=ran.get) and micro < oom, probe_table
    assert micro * summary["grad_accum_steps"] == summary["effective_batch_size"] == 64
    # 80 rows less 4 held out: the second step is the epoch's short last one (runplan.total_steps), 12 rows
    assert summary["steps"] == 2 and summary["samples"] == 76


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
@pytest.mark.parametrize("model", ["tiny", "gpt2-124m"])
def test_qlora_trains_on_the_gpu(tmp_path, dataset, request, bits, model):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    from tunebench.model import models

    tok = request.getfixturevalue("gpt2_tokenizer") if model == "gpt2-124m" else None
    out = tmp_path / "q"
    s = finetune.run(cuda_config(dataset, out, model, tok, **{
        "adapter.method": "qlora", "adapter.quantization": bits, "train.max_steps": 3}))
    losses = run_losses(out)
    assert s["quantization"] == bits and len(losses) == 3
    # finite, and near the untrained loss of a vocabulary-sized guess: ln(V) for random weights, within 3 nats
    vocab = 50257 if model == "gpt2-124m" else models.tiny()[0].config.vocab_size
    assert all(abs(v - math.log(vocab)) < 3 for v in losses.values()), (losses, math.log(vocab))
    assert math.isfinite(s["eval_loss"])
    lora_b = [t for n, t in run_weights(out).items() if "lora_B" in n]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # zero at the start: the adapters learned


def test_monitor_records_gpu_utilisation_and_memory(tmp_path):
    from tunebench.machine.monitor import Monitor

    path = tmp_path / "monitor.jsonl"
    a = torch.randn(4096, 4096, device="cuda")
    with Monitor(path, interval_s=0.2, gpu_indices=(0,)) as m:
        start = time.time()
        while time.time() - start < 2.0:
            a @ a
        torch.cuda.synchronize()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all("gpu0_util_percent" in r and "gpu0_memory_mb" in r for r in rows), rows[:2]
    assert max(r["gpu0_util_percent"] for r in rows) > 50
    assert max(r["gpu0_memory_mb"] for r in rows) > 64  # the 64 MiB matrix, at least
    summary = m.summary()
    assert summary["mean_gpu0_util_percent"] > 0 and summary["peak_gpu0_memory_mb"] > 64


def test_compare_runs_the_studys_gpu_configurations_and_keeps_them(tmp_path, gpt2_tokenizer):
    results = tmp_path / "results.csv"
    command = [sys.executable, "-m", "tunebench", "compare", "--matrix", "study", "--device", "cuda",
               "--model", "gpt2-124m", "--tokenizer", gpt2_tokenizer, "--data", "builtin:customer-support",
               "--max-samples", "96", "--max-steps", "4", "--output", str(results)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["experiment"]: r for r in csv.DictReader(results.open())}
    expected = {"bs1_ga8", "bs2_ga4", "bs4_ga2", "bs8_ga1", "bs8_ga1_8bit", "bs8_ga1_4bit", "auto"}
    assert set(rows) == expected
    quantized_ok = importlib.util.find_spec("bitsandbytes") is not None
    for name, r in rows.items():
        if "bit" in name and not quantized_ok:
            assert r["status"] == "error" and "bitsandbytes" in r["message"]
            continue
        assert r["status"] == "ok", (name, r["message"])
        assert r["device"] == "cuda" and torch.cuda.get_device_name(0) in r["device_name"]
        assert int(r["effective_batch"]) == 8 and int(r["batch_size"]) * int(r["grad_accum"]) == 8
        assert float(r["tokens_per_s"]) > 0 and float(r["peak_memory_mb"]) > 0
    assert rows["bs8_ga1_4bit"]["status"] != "ok" or rows["bs8_ga1_4bit"]["quantization"] == "4bit"
    assert (tmp_path / "report" / "report.html").is_file()
    again = subprocess.run(command, capture_output=True, text=True)  # the same sweep again: nothing reruns
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"7 already in {results}, 0 to run" in again.stdout
    assert [r["run_dir"] for r in csv.DictReader(results.open())] == [r["run_dir"] for r in rows.values()]


def test_liger_kernels_when_installed(tmp_path, dataset):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    out = tmp_path / "liger"
    finetune.run(cuda_config(dataset, out, **{"train.liger": "on", "train.max_steps": 2}))
    assert _plan(out)["liger"][0] is True


def test_flash_attention_when_installed(tmp_path, dataset):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    out = tmp_path / "flash"
    finetune.run(cuda_config(dataset, out, **{"train.attention": "flash_attention_2", "train.max_steps": 2}))
    assert _plan(out)["attention"][0] == "flash_attention_2"


def test_the_probe_falls_back_to_gradient_checkpointing_when_one_row_does_not_fit(tmp_path, gpt2_tokenizer,
                                                                                   capsys, monkeypatch):
    """The GPU is filled until one row of 1,024 tokens fits only with recomputation: the headroom left is
    measured here, between one row's peak with and without gradient checkpointing, on the run's own model."""
    from tunebench.core import precision as precision_
    from tunebench.data import batching
    from tunebench.model import models
    from tunebench.training.autotune import batch
    from tunebench.training.autotune.probe import enable_checkpointing, probe_step

    monkeypatch.setattr(batch, "memory_budget_mb", lambda device, ranks_sharing=1: (
        torch.cuda.memory_allocated(device) / 2**20, torch.cuda.mem_get_info(device)[1] / 2**20))
    data = _long_rows(tmp_path / "long.jsonl", 16)
    cfg = cuda_config(data, tmp_path / "calibrate", "gpt2-124m", gpt2_tokenizer, **{"data.max_length": 1024})
    device = torch.device("cuda")
    precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"

    def one_row_peak(checkpointing: bool) -> float:
        """MB one probe step of a 1,024-token row allocates beyond the weights it starts with."""
        from tunebench.data.tokenize import load_tokenized

        loaded = models.resolve("gpt2-124m", gpt2_tokenizer)
        pad = loaded.tokenizer.pad_token_id
        tokenized = load_tokenized(cfg.data, loaded.tokenizer, None)
        model, _ = finetune_model.build_model(cfg, loaded, precision, device)
        autocast = precision_.autocast_dtype(precision)
        if checkpointing:
            enable_checkpointing(model)
        held = torch.cuda.memory_allocated() / 2**20
        _, peak = probe_step(model, lambda size: batching.collate(tokenized, [0] * size, pad), device, autocast)(1)
        model.to("cpu")
        torch.cuda.empty_cache()
        return peak - held

    plain, recomputed = one_row_peak(False), one_row_peak(True)
    assert recomputed < 0.7 * plain, (plain, recomputed)  # otherwise there is no gap to leave
    weights_mb = 1_000  # the base, adapters, CUDA context and allocator slack, generously
    with gpu_filled_but(int((weights_mb + (plain + recomputed) / 2) * 2**20)):
        summary = finetune.run(cuda_config(data, tmp_path / "ckpt", "gpt2-124m", gpt2_tokenizer, **{
            "data.max_length": 1024, "train.micro_batch_size": "auto", "train.effective_batch_size": 4,
            "train.max_steps": 2, "data.eval_fraction": 0.0}))
    printed = capsys.readouterr().out
    # Whichever measurement found it first turns checkpointing on: the attention pick (its rows fit no kernel
    # without it; what an H100 did) or the batch probe (micro batch 1 did not fit without it).
    assert re.search(r"gradient_checkpointing +True +.*(did not fit|fit no attention kernel) without it", printed), \
        printed[-3000:]
    assert summary["steps"] == 2 and summary["micro_batch_size"] * summary["grad_accum_steps"] == 4


@pytest.mark.parametrize("method,extra", [
    ("dora", {}), ("ia3", {"train.lr": 3e-3}), ("loha", {}), ("lokr", {}),
    ("prefix", {"adapter.num_virtual_tokens": 4}), ("prompt", {"adapter.num_virtual_tokens": 4}),
])
def test_every_peft_method_trains_on_the_gpu(tmp_path, dataset, method, extra):
    out = tmp_path / method
    s = finetune.run(cuda_config(dataset, out, **{"adapter.method": method, "train.max_steps": 3, **extra}))
    losses = run_losses(out)
    assert s["device"] == "cuda" and s["method"] == method and len(losses) == 3
    assert all(math.isfinite(v) for v in losses.values()) and math.isfinite(s["eval_loss"])
    assert run_weights(out)  # the adapter was saved


def test_compile_on_cuda_trains_as_eager_does(tmp_path, dataset):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    finetune.run(cuda_config(dataset, eager, **{"train.max_steps": 4}))
    finetune.run(cuda_config(dataset, compiled, **{"train.max_steps": 4, "train.compile": "on"}))
    assert _plan(compiled)["compile"][0] is True and _plan(eager)["compile"][0] is False
    a, b = run_losses(eager), run_losses(compiled)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:  # inductor's fused kernels round differently in bf16; the training is the same
        assert b[step] == pytest.approx(a[step], rel=2e-2), step


def test_packed_rows_with_flash_attention_match_padded_rows(tmp_path, dataset):
    """flash-attn's variable-length path sees each packed example alone (position ids restart), so a
    packed run trains on what a padded run does."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    finetune.run(cuda_config(dataset, padded, **{"train.attention": "sdpa", "data.packing": "off",
                                                  "train.max_steps": 3}))
    finetune.run(cuda_config(dataset, packed, **{"train.attention": "flash_attention_2", "data.packing": "on",
                                                  "train.max_steps": 3}))
    assert _plan(packed)["batch layout"][0] == "packed" and _plan(packed)["attention"][0] == "flash_attention_2"
    a, b = run_losses(padded), run_losses(packed)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=3e-2), step


def test_liger_kernels_on_packed_rows(tmp_path, dataset):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    out = tmp_path / "liger-packed"
    s = finetune.run(cuda_config(dataset, out, **{"train.liger": "on", "data.packing": "on", "train.max_steps": 3}))
    assert _plan(out)["liger"][0] is True and _plan(out)["batch layout"][0] == "packed"
    assert all(math.isfinite(v) for v in run_losses(out).values()) and math.isfinite(s["eval_loss"])


def test_dpo_on_the_gpu_starts_at_ln2_and_logs_the_rewards(tmp_path):
    out = tmp_path / "dpo"
    s = finetune.run(cuda_config(pairs_file(tmp_path), out, **{"train.objective": "dpo", "train.max_steps": 4}))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy is its reference at the start
    assert all("rewards/accuracies" in r for r in steps)
    assert s["device"] == "cuda" and s["objective"] == "dpo" and "eval_rewards/accuracies" in s


def test_pretraining_the_gpu_model_resumes_after_sigterm(tmp_path):
    """The shipped gpu_model (Llama-style: rotary positions, SwiGLU), cut to 2 x 256 at 128 tokens, on the GPU."""
    from tunebench.data import tokenizer_training as tokenizer
    from tunebench.jobs import pretrain
    from tunebench.settings import pretrain as pretrain_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times.\n"
                              for i in range(2000)))
    tokenizer.train([str(corpus)], 100, "char", tmp_path / "tok", quiet=True)

    def config(out, **extra):
        return pretrain_config.load("gpu_model", {
            "data.train_file": str(corpus), "data.tokenizer": str(tmp_path / "tok"), "data.max_length": 128,
            "data.vocab_size": 100, "model.vocab_size": 100, "model.d_model": 256, "model.n_heads": 4,
            "model.n_layers": 2, "model.d_ff": 512, "model.max_seq_len": 128, "training.batch_size": 4,
            "training.effective_batch_size": 8, "training.max_steps": 6, "training.warmup_steps": 1,
            "training.eval_steps": 3, "training.save_steps": None, "training.logging_steps": 1,
            "training.checkpoint_dir": str(out), "training.progress": False, "training.compile": "off", **extra})

    full = pretrain.run(config(tmp_path / "full"))
    expected = run_losses(tmp_path / "full")
    assert full["device"] == "cuda" and len(expected) == 6 and full["eval_loss"] < full["eval_loss_before"]
    with sigterm_after_step(3), pytest.raises(TunebenchError, match="interrupted at step 3"):
        pretrain.run(config(tmp_path / "part"))
    pretrain.run(config(tmp_path / "part", **{"training.resume": "auto"}))
    resumed = run_losses(tmp_path / "part")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-3, abs=1e-4), step


def test_eval_generate_and_serve_place_the_model_on_the_gpu(tmp_path, dataset, monkeypatch):
    from tunebench.interfaces.web.models import Registry, entries
    from tunebench.jobs import evaluate, generate
    from tunebench.model import inference
    from tunebench.settings.finetune import DataConfig

    out = tmp_path / "run"
    finetune.run(cuda_config(dataset, out, **{"train.max_steps": 2}))
    result = evaluate.run("tiny", str(out), DataConfig(path=str(dataset), max_length=256), where=evaluate.Placement("auto"))
    assert result["device"] == "cuda" and math.isfinite(result["eval_loss"])

    placed = []
    real_place = inference.place

    def spy(loaded, device, precision):
        on = real_place(loaded, device, precision)
        placed.append(next(loaded.model.parameters()).device.type)
        return on

    monkeypatch.setattr(inference, "place", spy)
    text = generate.generate("tiny", str(out), "Placement is my order?", 8, 0.0, raw=False)
    assert isinstance(text, str) and placed == ["cuda"]

    registry = Registry(entries(["tiny"], [str(out)]), device="auto")
    assert registry.device == "cuda"
    for label in registry.labels:
        loaded, _ = registry.get(label)
        assert next(loaded.model.parameters()).device.type == "cuda", label


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_decoding_replays_its_step_as_a_cuda_graph_and_makes_the_dynamic_caches_tokens(kernel, caplog):
    """model/decoding.py's static path on a GPU: the step captured once and replayed, greedy tokens equal to the
    eager DynamicCache loop's under the same bf16 autocast, and no fall-back said."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tunebench.model import decoding

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=256, n_embd=128, n_layer=2, n_head=4,
                                       initializer_range=0.5)).eval().cuda().to(torch.bfloat16)
    model.config._attn_implementation = kernel
    ids = torch.randint(3, 512, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :7] = 0  # left padding
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), caplog.at_level("WARNING"):
        dynamic = decoding.decode(model, ids, mask, 40, None, 0, cache="dynamic")
        static = decoding.decode(model, ids, mask, 40, None, 0, cache="static")
    assert "decoding eagerly" not in caplog.text
    assert static.tolist() == dynamic.tolist()
