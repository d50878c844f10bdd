import contextlib
import dataclasses
import json
import os
import re
import types

import pytest
import torch

from conftest import add_lora
from tunebench.core import startup
from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.machine import cpuspeed, hardware, metrics
from tunebench.machine.hardware import GPU, Hardware
from tunebench.machine.metrics import mfu, training_flops_per_token
from tunebench.machine.monitor import Monitor
from tunebench.model import kernels, methods, models
from tunebench.settings.finetune import load_config, profiles
from tunebench.training import autotune
from tunebench.training.autotune import attention, batch, compiler

SPR_FLAGS = "fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"


def machine(flags="avx2", gpus=(), mps=False, cores=8):
    return Hardware("test cpu", cores, cores * 2, frozenset(flags.split()), 32000, 30000, "Linux", tuple(gpus), mps)


T4 = GPU(0, "Tesla T4", 15360, (7, 5))
A100 = GPU(0, "NVIDIA A100-SXM4-80GB", 81920, (8, 0))
H100 = GPU(0, "NVIDIA H100 80GB HBM3", 81559, (9, 0))


def test_cpuinfo_parsing_from_fixture():
    text = f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: {SPR_FLAGS}\n\n" \
           f"processor\t: 1\nmodel name\t: ignored\nflags\t\t: sse\n"
    model, flags = hardware.parse_cpuinfo(text)
    assert model == "Intel(R) Xeon(R) Platinum 8481C"
    assert {"amx_bf16", "avx512_bf16"} <= flags and "sse" in flags
    assert hardware.parse_cpuinfo("Features\t: fp asimd bf16\n")[1] == frozenset({"fp", "asimd", "bf16"})


@pytest.mark.parametrize("hw, device, precision, reason", [
    (machine("avx2 fma"), "cpu", "fp32", "no native bf16"),
    (machine(SPR_FLAGS), "cpu", "bf16", "AMX-BF16"),
    (machine("avx2 avx512f avx512_bf16"), "cpu", "bf16", "AVX512-BF16"),
    # AVX512-BF16 without AMX: the faster precision as measured here (an AMD EPYC's bf16, an Intel Xeon's fp32)
    (dataclasses.replace(machine("avx2 avx512f avx512_bf16"), bf16_over_fp32=1.9), "cpu", "bf16",
     "CPU has AVX512-BF16 (no AMX): a step's matmuls measured 1.90x as fast in bf16 as in fp32 here"),
    (dataclasses.replace(machine("avx2 avx512f avx512_bf16"), bf16_over_fp32=0.72), "cpu", "fp32",
     "CPU has AVX512-BF16 but no AMX, and a step's matmuls measured 0.72x as fast in bf16 as in fp32 here: fp32 "
     "trains faster"),
    (machine(gpus=[T4]), "cuda", "fp16", "lacks bf16"),
    (machine(gpus=[A100]), "cuda", "bf16", "bf16 tensor cores"),
    (machine(gpus=[H100]), "cuda", "bf16", "bf16 tensor cores"),
    (machine(mps=True), "mps", "fp32", "MPS"),
])
def test_decision_table(hw, device, precision, reason):
    plan = hardware.plan("auto", "auto", hw, env={})  # the table is the machine's, whatever OMP_NUM_THREADS says
    assert (plan.device, plan.precision) == (device, precision)
    assert reason in next(d.reason for d in plan.decisions if d.setting == "precision")
    assert plan.threads == 8
    if device == "cuda":
        assert plan.value("tf32") == (hw.gpus[0].capability >= (8, 0))
        assert plan.value("pin_memory") is True
    assert all(d.reason for d in plan.decisions)


@pytest.mark.parametrize("hw, precision, reason", [
    (machine("avx2"), "bf16", "asked for (emulated: this CPU has no AVX512-BF16 or AMX-BF16, so it runs slower than fp32)"),
    (machine(SPR_FLAGS), "bf16", "asked for (native on this CPU)"),
    (machine("avx2 avx512f avx512_bf16"), "bf16", "asked for (native on this CPU)"),
    (machine(SPR_FLAGS), "fp16", "asked for (emulated: this CPU has no AMX-FP16, so it runs slower than fp32; fp16 with "
                                 "a GradScaler)"),
    (machine(SPR_FLAGS + " amx_fp16"), "fp16", "asked for (native on this CPU; fp16 with a GradScaler)"),
    (machine(SPR_FLAGS), "fp32", "asked for"),
])
def test_a_forced_precision_runs_on_any_cpu_and_says_how(hw, precision, reason):
    """A CPU computes every dtype (torch emulates what it lacks): what was asked is run, never refused or
    replaced, and the reason says whether it is native, so the bf16 and fp16 paths run on every machine."""
    plan = hardware.plan("cpu", precision, hw)
    assert plan.precision == precision and plan.decision("precision").reason == reason


@pytest.mark.parametrize("hw, device, precision, message", [
    (machine(gpus=[T4]), "cuda", "bf16", "needs an Ampere"),
    (machine(), "cuda", "auto", "no CUDA GPU"),
    (machine(), "mps", "auto", "MPS is not available"),
])
def test_forced_impossible_settings_raise(hw, device, precision, message):
    with pytest.raises(TunebenchError, match=message):
        hardware.plan(device, precision, hw)


def test_peak_table():
    assert hardware.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert hardware.gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert hardware.gpu_peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert hardware.gpu_peak_tflops("NVIDIA L40S", "bf16") == 362.0
    assert hardware.gpu_peak_tflops("NVIDIA L4", "bf16") == 121.0
    assert hardware.gpu_peak_tflops("NVIDIA A10G", "bf16") is None  # listed as unknown, not as an A10
    assert hardware.gpu_peak_tflops("Tesla T4", "bf16") is None
    assert hardware.gpu_peak_tflops("Some Future GPU", "bf16") is None
    peak, source = hardware.peak_tflops("cuda", "fp32", machine(gpus=[A100]), 8, "/nonexistent")
    assert peak == 156.0 and "tf32" in source
    assert mfu(1e9, 1000.0, None) is None  # unknown peak: n/a, never a guess


def test_bf16_against_fp32_is_measured_once_where_the_flags_do_not_say_which_is_faster(tmp_path, monkeypatch):
    """Only a CPU with AVX512-BF16 and no AMX is measured (AMX's tiles are faster, emulated bf16 is slower), once a
    CPU, thread count and torch: kept in the cache, and in the process for one whose cache moves; the figure is
    fp32's fastest step over bf16's, read from a clock that gives each precision a set time a step."""
    calls, measure = [], cpuspeed.measure_bf16_over_fp32
    monkeypatch.setattr(cpuspeed, "measure_bf16_over_fp32", lambda threads: calls.append(threads) or 0.72)
    monkeypatch.setattr(cpuspeed, "_BF16_MEASURED", {})
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "a"))
    avx512 = frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert cpuspeed.bf16_over_fp32("cpu", avx512 | {"amx_bf16"}, 2, "2.13") is None
    assert cpuspeed.bf16_over_fp32("cpu", frozenset({"avx2"}), 2, "2.13") is None and calls == []
    assert cpuspeed.bf16_over_fp32("cpu", avx512, 2, "2.13") == 0.72 == cpuspeed.bf16_over_fp32("cpu", avx512, 2,
                                                                                                 "2.13")
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "b"))
    assert cpuspeed.bf16_over_fp32("cpu", avx512, 2, "2.13") == 0.72 and calls == [2]
    assert cpuspeed.bf16_over_fp32("cpu", avx512, 1, "2.13") == 0.72 and calls == [2, 1]
    assert json.loads((tmp_path / "b" / "peak_flops.json").read_text()) == {
        "cpu|avx2,avx512_bf16,avx512f|2|2.13|bf16-over-fp32": 0.72, "cpu|avx2,avx512_bf16,avx512f|1|2.13|bf16-over-fp32": 0.72}

    steps = iter([0.0, 9.0, 0.0, 9.0] + [0.0, 1.0, 0.0, 0.5] * 3)  # the warm-up round's, then fp32 1 s, bf16 0.5 s
    clock = {"now": 0.0}

    def perf_counter():
        clock["now"] += next(steps)
        return clock["now"]

    monkeypatch.setattr(cpuspeed.time, "perf_counter", perf_counter)
    monkeypatch.setattr(cpuspeed, "BF16_STEP_SHAPE", (8, 16, 8))
    assert measure(1, rounds=3) == 2.0


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cpuspeed, "measure_cpu_peak_tflops", lambda d, t: calls.append((d, t)) or 1.5)
    hw = machine("avx512_bf16")
    cache = tmp_path / "peak.json"
    assert hardware.cpu_peak_tflops("bf16", hw, 2, cache) == 1.5
    assert hardware.cpu_peak_tflops("bf16", hw, 2, cache) == 1.5
    assert calls == [("bf16", 2)]
    assert hardware.cpu_peak_tflops("fp32", hw, 2, cache) == 1.5 and calls[-1] == ("fp32", 2)  # own key


def test_cpu_peak_is_the_best_sizes_flops_over_its_time(monkeypatch):
    """The peak is 2n^3 multiply-adds per matmul over the clock: checked with a clock that advances a
    set time per matmul, so the expected figure is known exactly."""
    import time as time_module

    per_matmul = {512: 0.001, 1024: 0.004, 2048: 0.050, 3072: 0.200}  # seconds a matmul of this size "takes"
    clock = {"now": 0.0, "n": 512}
    real_matmul = torch.Tensor.__matmul__

    def timed_matmul(a, b):
        clock["n"] = a.shape[0]
        clock["now"] += per_matmul[a.shape[0]]
        return real_matmul(a[:2, :2], b[:2, :2])  # no real work: the clock is what is measured

    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed_matmul)
    peak = cpuspeed.measure_cpu_peak_tflops("fp32", 1, seconds=0.3)
    best = max(2 * n**3 / t for n, t in per_matmul.items()) / 1e12  # 1024: 0.537 TFLOP/s
    assert peak == pytest.approx(best, rel=1e-9)


def test_cpu_peak_grows_with_size_until_it_stops_rising(monkeypatch):
    """Small matmuls stop at caches and threading overhead: the roofline keeps growing the size while
    the rate still rises by 2%, and stops after two sizes in a row that do not (one slow size, 2048 here, is a
    busy moment, not the roofline)."""
    import time as time_module

    rate = {512: 0.05, 1024: 0.10, 2048: 0.09, 3072: 0.148, 4096: 0.149, 6144: 0.150}  # TFLOP/s at each size
    clock, tried = {"now": 0.0}, []
    real_matmul = torch.Tensor.__matmul__

    def timed_matmul(a, b):
        n = a.shape[0]
        tried.append(n)
        clock["now"] += 2 * n**3 / (rate[n] * 1e12)
        return real_matmul(a[:2, :2], b[:2, :2])

    monkeypatch.setattr(time_module, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(torch, "randn", lambda n, m, dtype: torch.zeros(1, 1).expand(n, m))
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed_matmul)
    assert cpuspeed.measure_cpu_peak_tflops("fp32", 1, seconds=0.3) == pytest.approx(0.150)
    assert 6144 in tried  # 4096 and 6144 gained under 2%: the search ends there
    tried.clear()
    rate.update({4096: 0.149, 6144: 0.5})
    monkeypatch.setattr(cpuspeed, "PEAK_SIZES", (512, 1024, 2048, 3072, 4096, 5120, 6144))
    rate[5120] = 0.1485
    assert cpuspeed.measure_cpu_peak_tflops("fp32", 1, seconds=0.3) == pytest.approx(0.149)
    assert 6144 not in tried  # 4096 and 5120 did not rise by 2%: 6144 is never tried


def test_cpu_mfu_is_against_the_fma_limit_where_it_is_known(tmp_path, monkeypatch):
    monkeypatch.setattr(cpuspeed, "measure_cpu_peak_tflops", lambda d, t: 0.131)
    avx2 = dataclasses.replace(machine("avx2 fma"), cpu_mhz=2445.0)
    peak, source = hardware.peak_tflops("cpu", "fp32", avx2, 2, tmp_path / "p.json")
    assert peak == pytest.approx(2 * 2445e6 * 32 / 1e12)  # 0.156: the 0.131 a matmul reached is 84% of it
    assert "2 cores x 2,445 MHz x 32 fp32 FLOP/cycle" in source and "best measured fp32 matmul 0.131" in source
    assert hardware.fma_limit_tflops("fp32", dataclasses.replace(avx2, cpu_flags=frozenset({"avx512f"})), 2)[0] \
        == pytest.approx(2 * peak)
    # No clock, bf16, or a clock below what a matmul measurably reached: the measured figure, said so.
    assert hardware.peak_tflops("cpu", "fp32", machine("avx2"), 2, tmp_path / "p.json")[0] == 0.131
    native_bf16 = dataclasses.replace(machine("avx2 avx512f avx512_bf16"), cpu_mhz=2445.0)
    assert hardware.peak_tflops("cpu", "bf16", native_bf16, 2, tmp_path / "p.json") == (
        0.131, "best measured bf16 matmul of this CPU; no FMA limit: bf16 is measured only")
    # bf16 emulated on AVX2 runs on the fp32 FMA units: their limit is its roofline
    assert hardware.peak_tflops("cpu", "bf16", avx2, 2, tmp_path / "p.json")[0] == pytest.approx(2 * 2445e6 * 32 / 1e12)
    slow = dataclasses.replace(avx2, cpu_mhz=1000.0)
    peak, source = hardware.peak_tflops("cpu", "fp32", slow, 2, tmp_path / "p.json")
    assert peak == 0.131 and "clock is higher than reported" in source


def test_flops_per_token_match_what_torch_counts(tiny):
    """Training FLOPs per token against torch's FLOP counter over a real forward and backward: full
    fine-tuning is 6N + attention, LoRA on a frozen base 4N + 6 per adapter weight + attention."""
    from torch.utils.flop_counter import FlopCounterMode

    c = tiny.model.config  # 2 layers, hidden 64, 4 heads of 16, 2 kv heads, mlp 128, vocab 259
    per_layer = 64 * 64 + 2 * (64 * 2 * 16) + 64 * 64 + 3 * (64 * 128)  # q, k+v, o, gate/up/down
    matmul, layers, width = metrics.flop_dims(tiny.model)
    assert matmul == 2 * per_layer + 64 * c.vocab_size and layers == 2 and width == 64
    B, T = 2, 96
    x = torch.randint(0, c.vocab_size, (B, T))

    def counted(model) -> float:
        model.set_attn_implementation("eager")  # torch counts its matmuls; CPU sdpa has no FLOP formula
        with FlopCounterMode(display=False) as counter:
            model(input_ids=x, labels=x).loss.backward()
        return counter.get_total_flops() / (B * T)

    full = training_flops_per_token(matmul, matmul, layers, width, T, full=True)
    assert counted(tiny.model) == pytest.approx(full, rel=0.02)
    peft = add_lora(models.resolve("tiny").model, 8, 16, 0.0, ["q_proj", "v_proj"])
    trainable, _ = metrics.count_parameters(peft)
    assert metrics.flop_dims(peft)[0] == matmul  # adapters are not counted as base matmuls
    lora = training_flops_per_token(matmul, trainable, layers, width, T, full=False)
    # the first layer's frozen matmuls need no input gradient (nothing before them trains): a little under 4N
    assert 0.9 * lora < counted(peft) <= lora


def _shape(name: str) -> autotune.Shape:
    return autotune.Shape(name, "lora", "none", 8, "auto", 128, "test machine", "fp32", "", "auto", "auto", "auto")


def test_autotune_backs_off_at_oom_and_keeps_fitting_fastest():
    speed = {1: 100.0, 2: 180.0, 4: 250.0, 8: None}

    def step(size):
        if speed[size] is None:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return speed[size], 1000.0 + 100 * size

    result = batch.probe(step, [8, 1, 4, 2], 1e9, 1000.0, lambda e: isinstance(e, torch.OutOfMemoryError))
    assert result.micro_batch_size == 4
    assert [(p.micro_batch_size, p.status) for p in result.probes] == [(1, "ok"), (2, "ok"), (4, "ok"), (8, "oom")]


class FakeCompiler:
    """Stands in for regional compilation: compiled steps run at `compiled` tokens/s, and the
    first step after each compile takes `warmup` s longer (shorter once the disk cache is warm)."""

    def __init__(self, monkeypatch, eager=100.0, compiled=150.0, warmups=(0.3, 0.1)):
        self.eager, self.compiled, self.warmups = eager, compiled, list(warmups)
        self.on, self.fresh, self.forced_eager, self.compiles, self.measured = False, False, False, 0, 0
        # compiler's clock is this fake's: a warm-up advances it by exactly its seconds (a sleep would be the
        # machine's, longer under load), and the steady probes take none
        self.now = 0.0
        monkeypatch.setattr(compiler, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        monkeypatch.setattr(compiler, "compile_blocks", self.compile)
        monkeypatch.setattr(compiler, "uncompile_blocks", lambda model: setattr(self, "on", False))
        monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
        monkeypatch.setattr(torch.compiler, "set_stance", self.stance)

    @contextlib.contextmanager
    def stance(self, name):
        assert name == "force_eager"
        self.forced_eager = True
        yield
        self.forced_eager = False

    def compile(self, model, mode="default"):
        self.on, self.fresh = True, True
        self.compiles += 1

    def measure(self):
        self.measured += 1
        if self.fresh:
            self.now += self.warmups[min(self.compiles, len(self.warmups)) - 1]
            self.fresh = False
        return self.compiled if self.on and not self.forced_eager else self.eager


def test_compile_auto_measures_long_runs_and_caches_the_warm_warm_up(monkeypatch):
    auto = Decision("compile", "auto", "")
    fake = FakeCompiler(monkeypatch)
    # too short to measure: 5,000 tokens at 100 tokens/s is 50 s
    row = compiler.pick(None, auto, False, fake.measure, 5_000, _shape("k1"), 1)
    assert row[1] is False and "too short" in row[2] and fake.compiles == 0 and fake.measured == 1
    # the batch probe's speed, when given, stands in for that probe step
    row = compiler.pick(None, auto, False, fake.measure, 5_000, _shape("k1"), 1, eager_speed=100.0)
    assert row[1] is False and "~50 s" in row[2] and fake.measured == 1
    assert autotune.cached(_shape("k1").key("compile", micro_batch_size=1)) is None
    # long enough: measured, compiled twice (cold, then from the compiler's cache), kept
    row = compiler.pick(None, auto, False, fake.measure, 100_000, _shape("k1"), 1)
    assert row[1] is True and fake.on and fake.compiles == 2 and "150 vs 100" in row[2]
    hit = autotune.cached(_shape("k1").key("compile", micro_batch_size=1))
    assert hit == {"eager": 100, "compiled": 150, "warmup_s": 0.1}  # the warm (second) warm-up is the one cached
    # cached: a run that saves more than the warm-up compiles; one that saves less does not
    fake.on, fake.compiles = False, 0
    assert compiler.pick(None, auto, False, fake.measure, 100_000, _shape("k1"), 1)[1] is True and fake.compiles == 1
    fake.on, fake.compiles = False, 0
    row = compiler.pick(None, auto, False, fake.measure, 20, _shape("k1"), 1)  # 0.2 s run saves ~0.07 s
    assert row[1] is False and "warm-up" in row[2] and fake.compiles == 0


def test_compile_auto_drops_a_compile_that_does_not_help(monkeypatch):
    fake = FakeCompiler(monkeypatch, compiled=101.0)
    row = compiler.pick(None, Decision("compile", "auto", ""), False, fake.measure, 100_000, _shape("k2"), 1)
    assert row[1] is False and "no gain" in row[2] and not fake.on
    fake.compiles = 0
    row = compiler.pick(None, Decision("compile", "auto", ""), False, fake.measure, 100_000, _shape("k2"), 1)
    assert row[1] is False and "no gain" in row[2] and fake.compiles == 0  # from the cache, not remeasured


def test_compile_asked_for_or_refused(monkeypatch):
    fake = FakeCompiler(monkeypatch)
    assert compiler.pick(None, Decision("compile", True, "asked for"), False, fake.measure, 1, _shape("k3"), 1) == \
        ("compile", True, "asked for") and fake.compiles == 1
    row = compiler.pick(None, Decision("compile", "auto", ""), True, fake.measure, 1e9, _shape("k3"), 1)
    assert row[1] is False and "bitsandbytes" in row[2] and fake.compiles == 1


class FakeAttentionModel:
    def __init__(self, speeds: dict[str, float]):
        self.speeds, self.impl, self.tried = speeds, None, []

    def set_attn_implementation(self, impl):
        self.impl = impl

    def measure(self) -> float:
        self.tried.append(self.impl)
        return self.speeds[self.impl]

    def zero_grad(self, set_to_none=True):
        pass


def test_pick_attention_never_tries_a_kernel_that_would_not_fit():
    model = FakeAttentionModel({"sdpa": 50.0, "eager": 90.0, "tunebench": 100.0})
    row = attention.pick(model, "auto", model.measure, _shape("fit1"))
    assert row[1] == "tunebench" and set(model.tried) == {"sdpa", "eager", "tunebench"}
    # the cached winner would not fit a longer run now: measured again, without the quadratic kernels
    model.tried.clear()
    quadratic = lambda impl: "needs 30 GB" if impl != "sdpa" else None  # noqa: E731
    row = attention.pick(model, "auto", model.measure, _shape("fit1"), quadratic)
    assert row[1] == "sdpa" and set(model.tried) == {"sdpa"}
    assert "eager skipped: needs 30 GB" in row[2] and "tunebench skipped: needs 30 GB" in row[2]
    # a kernel that raises OOM (a GPU does) drops out; nothing fitting is a one-line error
    model = FakeAttentionModel({"sdpa": 50.0, "eager": 90.0})
    assert attention.pick(model, "auto", model.measure, _shape("fit2"), is_oom=lambda e: isinstance(e, KeyError))[1] == "eager"
    with pytest.raises(TunebenchError, match="no attention kernel fits in memory.*lower --max-length"):
        attention.pick(model, "auto", model.measure, _shape("fit3"), lambda impl: "too big")


def test_a_kernel_is_not_measured_where_a_measured_ones_peak_says_its_step_would_not_fit(monkeypatch):
    """The towns benchmark's RFT probe on a 23 GB machine (4 rows x 1,024 tokens, 30 layers, 9 heads, fp32): our
    kernel peaked at 20.1 GB keeping 4,320 MB of attention weights; eager keeps as many, so it would peak there
    too, past the 18.6 GB a step may reach (it was measured, and the OOM killer ended the run); sdpa keeps none:
    ~15.8 GB predicted, measured (9.3 GB)."""
    monkeypatch.setattr(attention, "memory_free_mb", lambda device: 17_600.0)
    monkeypatch.setattr(attention, "memory_budget_mb", lambda device: (1_000.0, 18_600.0))
    model = FakeAttentionModel({"tunebench": 141.0, "eager": 130.0, "sdpa": 120.0})
    model.config = types.SimpleNamespace(num_hidden_layers=30, num_attention_heads=9)
    peaks = {}
    measure = lambda: peaks.setdefault(model.impl, {"tunebench": 20_100.0, "eager": 24_000.0,  # noqa: E731
                                                    "sdpa": 9_300.0}[model.impl]) and model.measure()
    too_big = attention.fit(model, 4, 1024, "fp32", torch.device("cpu"), lambda: dict(peaks))
    row = attention.pick(model, "auto", measure, _shape("peaks"), too_big, candidates=("tunebench", "eager", "sdpa"))
    assert row[1] == "tunebench" and "eager" not in model.tried and set(model.tried) == {"tunebench", "sdpa"}
    assert "eager skipped: predicted to peak at ~20,100 MB, past the 18,600 MB a step may reach: tunebench peaked " \
        "at 20,100 MB at 4 x 1024 tokens, keeping 4,320 MB of attention weights to its 4,320" in row[2]


def test_the_first_kernel_is_not_measured_where_the_memory_plan_of_its_probe_step_would_not_fit(monkeypatch):
    """Before any kernel was measured only the memory plan says what a probe step would peak at: the towns RFT probe
    (4 rows x 1,024 tokens) on a machine with 10.6 GB a step may reach. Our kernel and eager, planned past it, are
    not timed (the first kernel timed had no check but its kept weights, and the OOM killer ended the run); sdpa,
    planned within, is, and what it peaked at then predicts the others, as before."""
    monkeypatch.setattr(attention, "memory_free_mb", lambda device: 9_600.0)
    monkeypatch.setattr(attention, "memory_budget_mb", lambda device: (1_000.0, 10_600.0))
    model = FakeAttentionModel({"tunebench": 141.0, "eager": 130.0, "sdpa": 120.0})
    model.config = types.SimpleNamespace(num_hidden_layers=30, num_attention_heads=9)
    peaks = {}
    measure = lambda: peaks.setdefault(model.impl, 9_300.0) and model.measure()  # noqa: E731
    planned = {"tunebench": 14_800.0, "eager": 19_000.0, "sdpa": 9_000.0}
    too_big = attention.fit(model, 1, 1024, "fp32", torch.device("cpu"), lambda: dict(peaks), planned.get)
    assert too_big("sdpa") is None  # nothing measured: the plan decides
    assert too_big("tunebench") == "its memory plan at 1 x 1024 tokens peaks at ~14,800 MB, past the 10,600 MB a " \
        "step may reach"
    row = attention.pick(model, "auto", measure, _shape("planned"), too_big, candidates=("tunebench", "eager", "sdpa"))
    assert row[1] == "sdpa" and model.tried == ["sdpa"]
    assert "eager skipped: its memory plan at 1 x 1024 tokens peaks at ~19,000 MB" in row[2]
    # once sdpa peaked, what it held predicts the others, not the plan: sdpa at 5,000 MB leaves our kernel room
    peaks = {"sdpa": 5_000.0}
    assert too_big("tunebench") is None


def test_a_size_the_attention_pick_saw_past_the_budget_is_over_it_and_never_timed_again():
    """The towns RFT probe: micro 1 (4 rows x 1,024 tokens) peaked at 20.1 GB in the attention pick, past an 18.6 GB
    budget; the sweep takes it as over budget, with every larger size, and times none of them again (it timed it
    again, and held 24.3 GB of a 23 GB machine): no size fits, so checkpointing is the caller's to turn on."""
    def step(size):
        raise AssertionError(f"micro {size} timed")

    result = batch.probe(step, [1, 2, 4], 18_600.0, 1_000.0, lambda e: False, None, None,
                         {1: (166.0, 20_100.0, 60.0)})
    assert result.micro_batch_size == 0
    assert [(p.micro_batch_size, p.status) for p in result.probes] == [
        (1, "over budget"), (2, "skipped: over budget"), (4, "skipped: over budget")]
    fits = batch.probe(lambda size: (100.0 * size, 1_000.0 * size), [1, 2, 4], 18_600.0, 500.0, lambda e: False, None,
                       None, {4: (300.0, 20_100.0, 60.0)})  # one over budget above: the smaller sizes still measured
    assert fits.micro_batch_size == 2 and [p.status for p in fits.probes] == ["ok", "ok", "over budget"]


def test_a_second_round_only_where_the_first_leaves_the_kernels_apart():
    alike = FakeAttentionModel({"sdpa": 100.0, "eager": 99.0, "tunebench": 103.0})
    assert attention.pick(alike, "auto", alike.measure, _shape("alike"))[1] == "tunebench"
    assert len(alike.tried) == 3  # within 5%: one round
    apart = FakeAttentionModel({"sdpa": 100.0, "eager": 80.0, "tunebench": 103.0})
    attention.pick(apart, "auto", apart.measure, _shape("apart"))
    assert len(apart.tried) == 6  # 29% apart: a second round confirms against drift


class Clock:
    """A fake clock that each fake measurement advances by its own cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_measuring_stops_where_it_would_cost_more_than_a_tenth_of_the_training_it_decides():
    """A 1.07B model on 2 cores took 196 s to measure for 96 s of training. Here each kernel takes 10 s to time
    at 100 tokens/s and the run is 50,000 tokens (500 s of training): measuring may take 50 s, the attention
    kernel half of it, so the first kernel is timed, the second fits (20 s), and the third is left out and said
    so; nothing partial is cached, so a longer run of the shape measures it. `--measure full` (no budget) times
    all three."""
    from tunebench.training.autotune.budget import Budget

    clock = Clock()
    model = FakeAttentionModel({"sdpa": 100.0, "eager": 90.0, "tunebench": 120.0})

    def measure():
        clock.now += 10.0
        return model.measure()

    budget = Budget(50_000, clock=clock)
    row = attention.pick(model, "auto", measure, _shape("budget1"), budget=budget)
    assert model.tried == ["sdpa", "eager"] and row[1] == "sdpa"
    assert "tunebench skipped: not measured: ~10 s more would take measuring past 50% of the 50 s, 10% of the " \
           "run's predicted 500 s of training; --measure full measures it" in row[2]
    assert autotune.cached(_shape("budget1").key("attention", candidates=attention.ATTENTION_KERNELS)) is None
    model.tried.clear()
    assert attention.pick(model, "auto", measure, _shape("budget1"))[1] == "tunebench" and len(model.tried) == 6
    # A short run still measures for the floor of 20 s (a small model's whole measurement fits in it): here
    # the first kernel's 10 s is all of the attention's half.
    clock.now, model.tried = 0.0, []
    assert attention.pick(model, "auto", measure, _shape("budget2"), budget=Budget(100, clock=clock))[1] == "sdpa"
    assert model.tried == ["sdpa"]
    # --time-budget 4m: the run trains 240 s at most, whatever its tokens would take (500 s here), so measuring may
    # take a tenth of that, with the floor: 24 s, the attention half of it 12 s: eager (10 s more) is not measured
    clock.now, model.tried = 0.0, []
    row = attention.pick(model, "auto", measure, _shape("budget3"), budget=Budget(50_000, clock=clock, cap_s=240.0))
    assert model.tried == ["sdpa"] and "past 50% of the 24 s, 10% of the run's --time-budget 240 s of training" \
        in row[2]

    # The batch probe with no record: 1 is measured, 2 on the clock (no gain seen yet); 4 would cost ~40 s and,
    # at half the +9% that 1 -> 2 gained, save ~22 s of the run's 500 s: not measured, and said so.
    def step(size):
        clock.now += 10.0 * size
        return 100.0 * (1 + size / 10), 1000.0 + size

    clock.now = 0.0
    result = batch.probe(step, [1, 2, 4, 8], 1e9, 0.0, lambda e: False, Budget(60_000, clock=clock))
    assert [(p.micro_batch_size, p.status) for p in result.probes] == [
        (1, "ok"), (2, "ok"), (4, "skipped: not measured"), (8, "skipped: not measured")]
    assert result.micro_batch_size == 2 and result.partial
    assert "; 4: not measured: ~40 s to measure against ~22 s it could save (half the +9% of micro 1 -> 2)" \
        in result.reason
    clock.now = 0.0
    assert batch.probe(step, [1, 2, 4, 8], 1e9, 0.0, lambda e: False).micro_batch_size == 8  # full: all four


def _curve(speeds: dict[int, float], seconds_per_row: float, clock: Clock, tried: list[int]):
    """A fake probe step: `speeds` tokens/s by micro batch, each step `seconds_per_row` x its rows on `clock`."""
    def step(size):
        tried.append(size)
        clock.now += seconds_per_row * size
        return speeds[size], 1000.0 + 10 * size
    return step


def test_the_sweep_climbs_while_a_step_up_repays_its_measuring_and_stops_where_it_flattens():
    """Issue 68: a sweep cut by a clock kept micro 2 while 1 -> 2 had gained +42%. Here 1 -> 2 gains +40% and
    the run is long (200,000 tokens: ~1,400 s at micro 2): half that gain at 4 would save ~230 s against ~12 s of
    measuring, so 4 is measured (+20%); 4 -> 8 gains 2%, flat, so 16 is not measured. A short run (2,000 tokens,
    ~14 s of training) stops after 2: 4 could save ~2 s, less than its measuring."""
    from tunebench.training.autotune.budget import Budget

    speeds = {1: 100.0, 2: 140.0, 4: 168.0, 8: 171.0, 16: 172.0}
    clock, tried = Clock(), []
    result = batch.probe(_curve(speeds, 1.0, clock, tried), [1, 2, 4, 8, 16], 1e9, 0.0, lambda e: False,
                         Budget(200_000, clock=clock))
    assert tried == [1, 2, 4, 8] and result.micro_batch_size == 8
    assert "16: not measured: micro 4 -> 8 gained +2%, flat" in result.reason
    clock.now, tried[:] = 0.0, []
    result = batch.probe(_curve(speeds, 1.0, clock, tried), [1, 2, 4, 8, 16], 1e9, 0.0, lambda e: False,
                         Budget(2_000, clock=clock))
    assert tried == [1, 2] and result.micro_batch_size == 2
    assert "4: not measured: ~4 s to measure against ~2 s it could save (half the +40% of micro 1 -> 2)" \
        in result.reason


def _record(name: str, unit: str, precision: str, attention: dict[str, float], micro: dict[int, float]):
    from tunebench.training.autotune import known
    outcome = known.Recorded("SmolLM2-135M", 134_515_008, 30, "lora", 128, 4, attention, micro)
    return known.Record(name, unit, precision, 2, "", "a test", (outcome,))


AVX2 = _record("avx2-fp32", "avx2", "fp32", {"tunebench": 148.5, "sdpa": 147.5, "eager": 139.0},
               {1: 96.0, 2: 136.0, 4: 170.0})
AMX = _record("amx-bf16", "amx", "bf16", {"tunebench": 806.0, "eager": 727.0, "sdpa": 575.0},
              {1: 479.0, 2: 671.0, 4: 892.0, 8: 981.0})


def test_each_machine_class_record_orders_and_predicts_the_candidates_it_measured():
    """Issue 68: an AVX2 fp32 class and an AMX bf16 class, each run too short to measure more than one
    candidate. Each measures its record's fastest kernel first and the kernel it measured at 4 rows is that
    size's micro batch figure (not timed again); the others are predicted from the record's ratios, said so.
    On AVX2, 2 and 1 are predicted 0.80x and 0.56x micro 4 and 8 (never measured there) is left out; on AMX,
    8 is predicted 1.10x micro 4 and chosen unmeasured, its memory predicted to fit."""
    from tunebench.training.autotune import known
    from tunebench.training.autotune.budget import Budget

    picked = {}
    for record, precision, real in ((AVX2, "fp32", {"tunebench": 150.0, "sdpa": 149.0, "eager": 140.0}),
                                    (AMX, "bf16", {"tunebench": 800.0, "eager": 720.0, "sdpa": 570.0})):
        k = known.nearest((AVX2, AMX), record.unit, precision, 2, 134_515_008, 128, "lora")
        assert k.record is record and k.differs == ()
        clock, model = Clock(), FakeAttentionModel(real)

        def measure(clock=clock, model=model):
            clock.now += 4.0
            return model.measure()

        budget = Budget(4_000, clock=clock)  # ~27 s of training at 150 tokens/s: room for one candidate
        row = attention.pick(model, "auto", measure, _shape(f"known-{record.name}"), budget=budget, known=k)
        tried: list[int] = []
        result = batch.probe(_curve({4: real[row[1]]}, 1.0, clock, tried), [1, 2, 4, 8], 1e9, 0.0,
                             lambda e: False, budget, k, seen={4: (real[row[1]], 1040.0, 4.0)})
        picked[record.name] = (model.tried, row, tried, result)
    tried_kernels, row, tried, result = picked["avx2-fp32"]
    assert tried_kernels == ["tunebench"] and row[1] == "tunebench" and tried == []
    assert "sdpa skipped: predicted 0.99x tunebench on record" in row[2] and "record: AVX2 fp32 machines" in row[2]
    assert [(p.micro_batch_size, p.status, p.tokens_per_s) for p in result.probes] == [
        (1, "predicted", 84.7), (2, "predicted", 120.0), (4, "ok", 150.0), (8, "skipped: not measured", None)]
    assert result.micro_batch_size == 4 and "8: not measured" in result.reason
    tried_kernels, row, tried, result = picked["amx-bf16"]
    assert tried_kernels == ["tunebench"] and row[1] == "tunebench" and tried == []
    assert "eager skipped: predicted 0.90x tunebench on record" in row[2] and "record: AMX bf16" in row[2]
    assert [(p.micro_batch_size, p.status) for p in result.probes] == [
        (1, "predicted"), (2, "predicted"), (4, "ok"), (8, "predicted")]
    assert result.micro_batch_size == 8 and result.reason.startswith("predicted fastest: 880 tokens/s, 1.10x")
    assert result.partial  # a longer run of the shape measures what was predicted


def test_a_record_never_makes_the_first_probe_blind_nor_overrules_a_flat_step():
    """With nothing timed yet (an attention kernel asked for), the first size measured is the smallest, whatever
    the record's fastest: nothing predicts a larger one's memory, and on a CPU a step past the RAM is the OOM
    killer. And where the run itself measured a flat step, a record that says the next size is faster is not
    taken: the measured 4 -> 8 (+1%) stops the climb, and 16 is not predicted."""
    from tunebench.training.autotune import known
    from tunebench.training.autotune.budget import Budget

    k = known.Known(AMX, AMX.outcomes[0], ())
    clock, tried = Clock(), []
    result = batch.probe(_curve({1: 480.0, 2: 670.0, 4: 890.0, 8: 980.0}, 0.5, clock, tried), [1, 2, 4, 8], 1e9, 0.0,
                         lambda e: False, Budget(400_000, clock=clock), k)
    assert tried[0] == 1 and result.micro_batch_size == 8  # the record then says each size up repays measuring
    record16 = _record("amx-16", "amx", "bf16", {"tunebench": 1.0}, {1: 100.0, 2: 150.0, 4: 200.0, 8: 300.0, 16: 400.0})
    k16 = known.Known(record16, record16.outcomes[0], ())
    clock, tried = Clock(), []
    result = batch.probe(_curve({1: 100.0, 2: 150.0, 4: 200.0, 8: 202.0, 16: 400.0}, 0.5, clock, tried),
                         [1, 2, 4, 8, 16], 1e9, 0.0, lambda e: False, Budget(400_000, clock=clock), k16)
    rows = {p.micro_batch_size: p for p in result.probes}
    assert tried == [1, 2, 4, 8] and rows[16].status == "skipped: not measured" and result.micro_batch_size == 8
    assert "micro 4 -> 8 gained +1%, flat" in rows[16].note


def test_a_record_is_taken_only_at_the_runs_precision_and_its_differences_are_named():
    from tunebench.training.autotune import known

    assert known.nearest((AMX,), "avx2", "fp32", 2, 134_515_008, 128, "lora") is None  # never across precisions
    k = known.nearest((AVX2, AMX), "avx512-bf16", "fp32", 16, 420_000_000, 512, "lora")
    assert k.record is AVX2  # an fp32 run on a bf16 machine: the fp32 record, its differences said
    assert k.source == ("AVX2 fp32 machines (SmolLM2-135M lora at 128 tokens, 2 cores; here: AVX512-BF16, "
                        "16 cores, 0.42B parameters, 512 tokens)")
    assert not k.same_shape  # another size and length: not the run's shape
    assert known.nearest((AVX2,), "avx512-bf16", "fp32", 16, 134_515_008, 128, "lora").same_shape  # another machine
    assert known.unit({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == "amx"
    assert known.unit({"avx2", "avx512f"}) == "avx512" and known.unit(set()) == "none"


def test_hw_record_writes_what_this_machine_measured_in_the_shipped_format(tmp_path, monkeypatch, capsys):
    """Issue 68: every machine teaches the record. The measurement cache's complete probes of this CPU at one
    precision (a batch probe with the model's size, the kernels timed for the same shape) are written as a
    record that the runs' lookup reads; a probe of another precision or CPU is not; an empty cache is refused
    in one line."""
    from tunebench.interfaces.cli import main
    from tunebench.jobs import hw
    from tunebench.training.autotune import known

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    machine, plan, _ = hw.machine()
    assert main(["hw", "--record", str(tmp_path / "none.json"), "--precision", "fp32"]) == 2
    assert "no complete measurement of this machine in fp32 is on record" in capsys.readouterr().err
    shape = dict(model="smollm2", method="lora", quantization="none", r=8, target_modules=None, max_length=128,
                 where=f"{machine.cpu_model} x{plan.threads}", precision="fp32", torch="2.13.0", attention="auto",
                 liger="auto", gradient_checkpointing="auto")
    probes = [{"micro_batch_size": m, "tokens_per_s": v, "peak_memory_mb": 900.0, "status": "ok"}
              for m, v in ((1, 100.0), (2, 150.0), (4, 180.0))]
    autotune.store(autotune.Shape(**shape).key("batch", effective_batch_size=8, rows=8),
               {"result": {"micro_batch_size": 4, "probes": probes, "reason": "", "partial": False},
                "model_params": 134_515_008, "model_layers": 30})
    autotune.store(autotune.Shape(**shape).key("attention", candidates=("tunebench", "eager", "sdpa")),
               {"value": "sdpa", "reason": "", "speeds": {"sdpa": 181.0, "tunebench": 175.0}, "rows": 4})
    autotune.store(autotune.Shape(**{**shape, "precision": "bf16"}).key("batch", effective_batch_size=8, rows=8),
               {"result": {"micro_batch_size": 1, "probes": probes[:1], "reason": "", "partial": False},
                "model_params": 1, "model_layers": 1})
    assert main(["hw", "--record", str(tmp_path / "mine.json"), "--precision", "fp32"]) == 0
    record = known.load(tmp_path / "mine.json")
    assert record.precision == "fp32" and record.unit == known.unit(machine.cpu_flags)
    (o,) = record.outcomes
    assert (o.params, o.layers, o.max_length, o.micro_batch, o.attention, o.attention_rows) == (
        134_515_008, 30, 128, {1: 100.0, 2: 150.0, 4: 180.0}, {"sdpa": 181.0, "tunebench": 175.0}, 4)
    k = known.nearest((record,), record.unit, "fp32", plan.threads, 134_515_008, 128, "lora")
    assert k.best_micro([1, 2, 4, 8]) == 4 and k.kernel_order(("tunebench", "eager", "sdpa"))[0] == "sdpa"
    assert main(["hw", "--record", str(tmp_path / "mine.json")]) == 2  # never over a file already written


def test_every_shipped_machine_record_loads_and_a_broken_one_is_refused_in_one_line(tmp_path):
    from tunebench.training.autotune import known

    records = known.shipped()
    assert {r.name for r in records} >= {"avx2-fp32", "avx512-bf16", "amx-bf16"}
    for r in records:
        assert r.outcomes and all(o.micro_batch and o.attention for o in r.outcomes) and r.source
        assert known.parse(r.to_dict(), r.name) == r  # what `hw --record` writes reads back the same
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1, "class": "x", "unit": "sse", "precision": "fp32", "cores": 2,
                               "outcomes": []}))
    with pytest.raises(TunebenchError, match=r"^machine record .*bad.json cannot be read \(ValueError: unit 'sse'"):
        known.load(bad)


def test_compile_is_measured_only_when_its_cost_fits_the_measuring_budget(monkeypatch):
    """Compile's measurement costs what it cost on this machine last time (90 s before it has been seen) beyond its
    8 probe calls, and those at what one took at the run's micro batch: a run of 500 s of training leaves 50 s and
    skips it, saying why; one of 2,000 s skips it where a probe call took 30 s, measures it where one took 0.25 s,
    and records the cost."""
    import dataclasses

    from tunebench.training.autotune.budget import Budget

    fake, auto = FakeCompiler(monkeypatch), Decision("compile", "auto", "")
    shape = dataclasses.replace(_shape("budget3"), where="Some CPU x2")  # autotune.where's form for a CPU
    clock = Clock()
    row = compiler.pick(None, auto, False, fake.measure, 50_000, shape, 1, 100.0, budget=Budget(50_000, clock=clock))
    assert row[1] is False and fake.compiles == 0, row
    assert "not measured: ~90 s more would take measuring past 50 s" in row[2]
    assert "(measuring compile: ~90 s, a first guess on a machine not seen compiling); --compile on to force" in row[2]
    # its 8 probe calls cost what one took at this micro batch: 30 s each (a GRPO arm's long rows) is 330 s, past
    # the 200 s a 2,000 s run leaves
    row = compiler.pick(None, auto, False, fake.measure, 200_000, shape, 1, 100.0, budget=Budget(200_000, clock=clock),
                        probe_s=30.0)
    assert row[1] is False and fake.compiles == 0, row
    assert "(measuring compile: ~330 s: compiling ~90 s, a first guess on a machine not seen compiling, and 8 " \
           "probes of 30.0 s)" in row[2]
    row = compiler.pick(None, auto, False, fake.measure, 200_000, shape, 1, 100.0, budget=Budget(200_000, clock=clock),
                        probe_s=0.25)
    assert row[1] is True and fake.compiles == 2, row
    seconds, known = compiler.measuring_cost(shape.where)  # under a second, 2 s of it its probes: none compiling
    assert seconds == 0 and known.endswith("as it took here last time")
    assert compiler.measuring_cost(shape.where, 30.0)[0] == 240


def test_flash_attention_joins_the_candidates_only_where_it_can_run(monkeypatch):
    import transformers.utils

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert attention.candidates(cuda, "bf16")[-1] == "flash_attention_2"
    assert "flash_attention_2" not in attention.candidates(cuda, "fp32")  # flash-attn runs 16-bit only
    assert "flash_attention_2" not in attention.candidates(cpu, "bf16")
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert attention.candidates(cuda, "bf16") == ("sdpa", "eager", "tunebench")

    model = FakeAttentionModel({"sdpa": 50.0, "eager": 90.0, "tunebench": 100.0, "flash_attention_2": 130.0})
    four = ("sdpa", "eager", "tunebench", "flash_attention_2")
    assert attention.pick(model, "auto", model.measure, _shape("flash1"), candidates=four)[1] == "flash_attention_2"
    assert model.impl == "flash_attention_2"
    with pytest.raises(TunebenchError, match="--attention flash_attention_2 cannot run here.*flash-attn"):
        attention.pick(model, "flash_attention_2", model.measure, _shape("flash2"))


def _fake_liger(monkeypatch, model_types):
    """A stand-in for liger-kernel's patching module (Triton kernels need a CUDA GPU to run)."""
    import sys
    import types

    calls = []
    mod = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mod.MODEL_TYPE_TO_APPLY_LIGER_FN = {t: None for t in model_types}
    mod._apply_liger_kernel_to_instance = lambda model, **flags: calls.append((model, flags))
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", mod)
    return calls


def test_liger_is_used_where_it_can_run_and_refused_where_asked_for_and_impossible(monkeypatch, tiny):
    import sys

    model = tiny.model  # a LlamaForCausalLM
    calls = _fake_liger(monkeypatch, ["llama"])
    assert methods.apply_liger(model, "off", "cuda") == ("liger", False, "off, as asked")
    row = methods.apply_liger(model, "auto", "cpu")
    assert row[1] is False and "CUDA" in row[2] and not calls
    with pytest.raises(TunebenchError, match="--liger on cannot be honoured.*CUDA"):
        methods.apply_liger(model, "on", "cpu")

    row = methods.apply_liger(model, "auto", "cuda")
    assert row[1] is True and "llama" in row[2]
    assert len(calls) == 1 and calls[0][0] is model
    assert calls[0][1]["rms_norm"] and not calls[0][1]["fused_linear_cross_entropy"]  # our fused head stays

    calls = _fake_liger(monkeypatch, ["qwen2"])
    row = methods.apply_liger(model, "auto", "cuda")
    assert row[1] is False and "model type 'llama'" in row[2] and not calls
    with pytest.raises(TunebenchError, match="no kernels for model type 'llama'"):
        methods.apply_liger(model, "on", "cuda")

    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not installed
    row = methods.apply_liger(model, "auto", "cuda")
    assert row[1] is False and "pip install liger-kernel" in row[2]
    with pytest.raises(TunebenchError, match="liger-kernel is not installed"):
        methods.apply_liger(model, "on", "cuda")


def test_autotune_never_tries_a_size_predicted_over_budget():
    tried = []

    def step(size):
        tried.append(size)
        return 10.0 * size, 1000.0 + 300 * size  # 300 MB per row above a 1000 MB baseline

    result = batch.probe(step, [1, 2, 4, 8], budget_mb=2500.0, baseline_mb=1000.0, is_oom=lambda e: False)
    assert tried == [1, 2, 4]  # 4 -> 2200 MB fits; 8 -> predicted 3400 MB is never run
    assert result.micro_batch_size == 4 and result.probes[-1].status.startswith("skipped")
    with pytest.raises(ValueError, match="^bug$"):  # not an OOM: the step's own error, unchanged
        batch.probe(lambda s: (_ for _ in ()).throw(ValueError("bug")), [1], 1e9, 0, lambda e: False)


def test_autotune_on_a_tiny_model_end_to_end(tmp_path, dataset, monkeypatch):
    from tunebench.jobs import finetune

    # A cache of its own: the entry read below is this run's. In the worker's shared one, an earlier test's run of
    # the same model, length and batch in another precision matched the key test first (seen once the suite's
    # files ran in another order: the cached pick 4 beside this run's 2).
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "auto"
    cfg = load_config(options={"model.name": "tiny", "data.path": str(dataset), "data.max_length": 256,
                               "train.micro_batch_size": "auto", "train.effective_batch_size": 4,
                               "train.max_steps": 2, "train.output_dir": str(out), "train.progress": False})
    summary = finetune.run(cfg)
    assert summary["micro_batch_size"] * summary["grad_accum_steps"] == 4 == summary["effective_batch_size"]
    entries = json.loads(autotune.cache_file().read_text())
    batch_key = next(k for k in entries if k.startswith("batch|") and '"model": "tiny"' in k
                     and '"max_length": 256' in k and '"effective_batch_size": 4' in k)
    found = entries[batch_key]["result"]
    # the pick is the fastest of the sizes measured that fit (none was predicted: no record covers the tiny model)
    measured = {p["micro_batch_size"]: p["tokens_per_s"] for p in found["probes"] if p["status"] == "ok"}
    assert found["micro_batch_size"] == summary["micro_batch_size"] == max(measured, key=measured.get)
    assert found["reason"] == f"fastest measured: {max(measured.values()):,.0f} tokens/s of {len(measured)} that fit"
    decisions = json.loads((tmp_path / "auto" / "plan.json").read_text())["decisions"]
    assert any(d["setting"] == "attention" and d["value"] in ("sdpa", "eager", "tunebench")
               and "measured" in d["reason"] for d in decisions)
    assert any(d["setting"] == "compile" and d["value"] is False and "too short" in d["reason"] for d in decisions)
    # MFU is the achieved FLOP/s over the peak the summary names (a unit slip anywhere between breaks the equality)
    assert summary["mfu"] == pytest.approx(summary["flops_per_token"] * summary["tokens_per_s"]
                                           / (summary["peak_tflops"] * 1e12), rel=1e-9) and summary["mfu"] < 1
    assert 0 <= summary["data_wait_fraction"] < 1


def test_a_run_never_tries_an_attention_kernel_that_would_not_fit(tmp_path, dataset, monkeypatch):
    from tunebench.jobs import finetune

    # A cache of its own: an earlier test's measured choice for this shape would be reused, untried.
    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    # Free memory for one row of tiny's sdpa step but not for any kernel's T x T weights at 256 tokens.
    need = kernels.saved_weights_mb(models.resolve("tiny").model.config, 2, 256, "tunebench", 4)
    monkeypatch.setattr(attention, "memory_free_mb", lambda device: need)
    tried = []
    real = attention.pick

    def spy(model, requested, measure, shape, too_big, **kw):
        return real(model, requested, lambda: tried.append(model.config._attn_implementation) or measure(), shape,
                    too_big, **kw)

    monkeypatch.setattr(attention, "pick", spy)
    cfg = load_config(options={"model.name": "tiny", "data.path": str(dataset), "data.max_length": 256,
                               "train.micro_batch_size": 2, "train.effective_batch_size": 2,
                               "train.max_steps": 1, "train.output_dir": str(tmp_path / "o"), "train.progress": False,
                               "train.precision": "fp32"})
    finetune.run(cfg)
    row = next(d for d in json.loads((tmp_path / "o" / "plan.json").read_text())["decisions"]
               if d["setting"] == "attention")
    assert row["value"] == "sdpa" and set(tried) == {"sdpa"}
    assert "eager skipped: its 2 x 256 x 256 attention weights need" in row["reason"]
    assert "tunebench skipped" in row["reason"]


def test_a_run_whose_attention_probe_the_memory_plan_says_would_not_fit_times_no_kernel_without_recomputation(
        tmp_path, dataset, monkeypatch):
    """The run's own memory plan of the attention pick's probe step reaches the pick: with no room, nothing is timed
    and the error names the plan; with room only for the plan with recomputation, `auto` turns it on first and
    every kernel is timed with it (a kernel timed without it was where the OOM killer ended a run)."""
    from tunebench.jobs import finetune
    from tunebench.training.autotune import probe

    monkeypatch.setenv("TUNEBENCH_CACHE", str(tmp_path / "cache"))
    tried = []
    real = attention.pick

    def spy(model, requested, measure, shape, too_big, **kw):
        return real(model, requested, lambda: tried.append(probe.checkpointing_on(methods.base_of(model))) or measure(), shape,
                    too_big, **kw)

    monkeypatch.setattr(attention, "pick", spy)
    plans = []  # the pick's `planned`: its kernels' probe steps as the run's memory plan counts them
    real_fit = attention.fit
    monkeypatch.setattr(attention, "fit", lambda *a: plans.append(a[6]) or real_fit(*a))
    options = {"model.name": "tiny", "data.path": str(dataset), "data.max_length": 256,
               "train.micro_batch_size": 2, "train.effective_batch_size": 2, "train.max_steps": 1,
               "train.output_dir": str(tmp_path / "o"), "train.progress": False, "train.precision": "fp32",
               "hardware.gradient_checkpointing": "off"}
    monkeypatch.setattr(attention, "memory_budget_mb", lambda device: (0.0, 1.0))
    with pytest.raises(TunebenchError, match="no attention kernel fits in memory") as e:
        finetune.run(load_config(options=options))
    assert tried == [] and re.search(r"sdpa: its memory plan at 2 x 256 tokens peaks at ~[\d,]+ MB, past the 1 MB",
                                     str(e.value))
    budget = []

    def just_under(device):  # this run's plan of sdpa's step without recomputation, less a hair, from its first look
        budget[:] = budget or [plans[-1]("sdpa") - 1e-6]
        return 0.0, budget[0]

    monkeypatch.setattr(attention, "memory_budget_mb", just_under)
    finetune.run(load_config(options={**options, "hardware.gradient_checkpointing": "auto"}))
    rows = {d["setting"]: d for d in json.loads((tmp_path / "o" / "plan.json").read_text())["decisions"]}
    assert rows["gradient_checkpointing"]["value"] is True and "fit no attention kernel without it" in \
        rows["gradient_checkpointing"]["reason"]
    assert tried and all(tried), tried


@pytest.mark.parametrize("name", profiles())
def test_every_shipped_profile_loads_and_validates(name):
    cfg = load_config(profile=name)
    assert cfg.batch.micro_batch_size is None
    assert set(profiles()) == {"cpu", "gpu-8-12gb", "gpu-24gb", "gpu-80gb"}


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(TunebenchError, match="shipped profiles: cpu, gpu-24gb"):
        load_config(profile="tpu")


def test_monitor_samples_in_the_background(tmp_path):
    import time

    path = tmp_path / "monitor.jsonl"
    with Monitor(path, interval_s=0.05) as m:
        time.sleep(0.3)
    summary = m.summary()
    assert summary["peak_process_rss_mb"] > 10 and "mean_cpu_percent" in summary
    assert len(path.read_text().splitlines()) >= 2


def test_lr_scaling_rules():
    from tunebench.jobs.parts.runner import scaled_lr

    assert scaled_lr(1e-4, 32, "linear", 8)[0] == pytest.approx(4e-4)
    assert scaled_lr(1e-4, 32, "sqrt", 8)[0] == pytest.approx(2e-4)
    assert scaled_lr(1e-4, 32, "none", 8)[0] == 1e-4
    lr, reason = scaled_lr(1e-4, 8, "linear", 8)
    assert lr == 1e-4 and "reference" in reason


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("kept", [False, True], ids=["glibc-defaults", "freed-memory-kept"])
def test_peak_memory_windows_measure_each_probe_alone(kept):
    """A probe's peak must be its own: the batch probe predicts larger sizes from it, and a peak
    left over from an earlier, bigger step would make it skip sizes that fit. Checked in a fresh
    process, with glibc's defaults and as the command runs (freed memory kept, see startup): a new
    window first hands the heap's free pages back, so a freed 400 MB is neither held nor counted."""
    import subprocess
    import sys

    script = """
import torch
from tunebench.machine.metrics import peak_memory_mb, process_peak_mb, reset_peak_memory
cpu = torch.device("cpu")
reset_peak_memory(cpu)
big = torch.ones(400 * 2**20 // 4)  # 400 MB, touched
del big
first = peak_memory_mb(cpu)
reset_peak_memory(cpu)
small = torch.ones(50 * 2**20 // 4)
del small
print(first, peak_memory_mb(cpu), process_peak_mb())
"""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if kept:
        if not startup.on_glibc():
            pytest.skip("freed memory is kept through glibc's tunables: Linux with glibc only")
        env["GLIBC_TUNABLES"] = startup.KEEP_FREED
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env=env).stdout
    first, second, process_peak = map(float, out.split())
    assert second < first - 300  # the 400 MB step is not in the second window
    assert process_peak >= first  # while the whole process's peak keeps it


GOLDEN_MACHINES = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("name", ["avx2", "avx512-bf16", "avx512-bf16-xeon", "amx", "h100", "gpu-24gb", "gpu-8gb", "apple-mps"])
def test_each_machine_class_plans_its_golden_settings_table(name, capsys):
    """Each class's decisions, planned from its recorded machine (tests/golden/machines/), equal the table
    recorded beside it: a change to a decision shows on every class, not only on the machine running this.
    A change that is meant is re-recorded in the same commit (tests/golden/make_machine_tables.py)."""
    import sys

    sys.path.insert(0, GOLDEN_MACHINES)
    try:
        from make_machine_tables import MACHINES, table
    finally:
        sys.path.remove(GOLDEN_MACHINES)
    record = MACHINES / f"{name}.json"
    assert table(record) == (MACHINES / f"{name}.txt").read_text(), (
        f"the settings tunebench picks on {name} changed; if that is meant, run "
        "python tests/golden/make_machine_tables.py and commit the tables")
    from tunebench.interfaces.cli import main

    assert main(["hw", "--machine", str(record)]) == 0  # the same table, as a user asks for it
    printed = capsys.readouterr().out
    _, value, reason = next(line for line in (MACHINES / f"{name}.txt").read_text().splitlines()
                            if line.startswith("precision |")).split(" | ")
    assert re.search(rf"\n  precision +{value} +{re.escape(reason)}\n", printed), printed
    assert "allocator" not in printed


@pytest.mark.parametrize("flags, precision, measured", [
    ("avx2 fma", "bf16", "fp32"),  # emulated bf16 runs on the fp32 units: their peak is the roofline
    ("avx2 fma", "fp16", "fp32"),
    ("avx2 avx512f avx512_bf16", "bf16", "bf16"),  # native: its own units, its own peak
    ("avx2 avx512f avx512_bf16", "fp16", "fp32"),
    (SPR_FLAGS + " amx_fp16", "fp16", "fp16"),
    ("avx2 fma", "fp32", "fp32"),
])
def test_mfu_is_against_the_units_that_do_the_math(monkeypatch, tmp_path, flags, precision, measured):
    asked = []
    monkeypatch.setattr(cpuspeed, "measure_cpu_peak_tflops", lambda dtype, threads: asked.append(dtype) or 1e-3)
    hardware.peak_tflops("cpu", precision, machine(flags), 8, tmp_path / "peak.json")
    assert asked == [measured]


def test_rows_that_fit_no_attention_kernel_turn_on_checkpointing_and_a_cached_run_does_too():
    """An H200 filled to 1.5 GB fit one 1,024-token GPT-2 row under no kernel without recomputation, and the run
    stopped before the batch probe could turn it on: with checkpointing on auto, the pick turns it on and
    measures again; the batch probe's cache records it, so a run that finds both cached turns it on as well."""
    from tunebench.model import models
    from tunebench.training.autotune import batch
    from tunebench.training.autotune.probe import checkpointing_on

    def step_for(model):
        def step(size):
            if not checkpointing_on(model):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return 100.0 * size, 1000.0 + size
        step.model = model
        return step

    cpu, shape = torch.device("cpu"), _shape("recompute")
    model = models.resolve("tiny").model
    with pytest.raises(attention.NoneFit, match="no attention kernel fits"):
        attention.decide(model, "auto", lambda: step_for(model)(1)[0], shape, 1, 256, "fp32", cpu, "off")
    rows = attention.decide(model, "auto", lambda: step_for(model)(1)[0], shape, 1, 256, "fp32", cpu, "auto")
    assert [r.setting for r in rows] == ["gradient_checkpointing", "attention"] and rows[0].value is True
    assert "fit no attention kernel without it" in rows[0].reason and checkpointing_on(model)
    micro, batch_rows, _ = batch.probed_micro_batch(step_for(model), shape, 4, 100, 256, cpu)
    assert micro == 4 and [r[0] for r in batch_rows] == ["micro_batch_size"]

    again = models.resolve("tiny").model  # a later run of the same shape: both picks come from the cache
    assert [r.setting for r in attention.decide(again, "auto", lambda: step_for(again)(1)[0], shape, 1, 256, "fp32",
                                                cpu, "auto")] == ["attention"]
    micro, batch_rows, _ = batch.probed_micro_batch(step_for(again), shape, 4, 100, 256, cpu)
    assert micro == 4 and checkpointing_on(again)
    assert ("gradient_checkpointing", True, "micro batch 1 did not fit without it (cached probe)") in batch_rows


def test_a_cuda_error_that_says_out_of_memory_is_an_oom_to_the_probes():
    """torch 2.11 on an H200 raised a full GPU's failed stream allocation as torch.AcceleratorError."""
    from tunebench.training.autotune.probe import is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_oom(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(RuntimeError("out of memory"))  # not a device error: a bug, re-raised


def test_a_run_above_the_measured_cpu_peak_raises_it_and_mfu_stays_at_most_one(tmp_path, monkeypatch):
    """A 1.07B model's GEMMs ran above the cached 'best measured bf16 matmul' and MFU read 103.6%: the ceiling
    becomes what the run reached, said so, and is recorded for the next run of this CPU."""
    monkeypatch.setattr(cpuspeed, "measure_cpu_peak_tflops", lambda d, t: 1.0)
    native_bf16 = machine("avx2 avx512f avx512_bf16")
    cache = tmp_path / "p.json"
    peak, source = hardware.peak_tflops("cpu", "bf16", native_bf16, 2, cache)
    assert peak == 1.0
    assert hardware.reached("cpu", "bf16", native_bf16, 2, cache, 0.9, peak, source) == (1.0, source)
    raised, why = hardware.reached("cpu", "bf16", native_bf16, 2, cache, 1.036, peak, source)
    assert raised == 1.036 and "this run's own 1.036 TFLOP/s, above the 1.000" in why and "was low" in why
    assert metrics.mfu(1e9, 1.036e3, raised) == pytest.approx(1.0)
    assert hardware.peak_tflops("cpu", "bf16", native_bf16, 2, cache)[0] == 1.036  # the next run's peak
    gpu = hardware.reached("cuda", "bf16", native_bf16, 2, cache, 2000.0, 989.0, "datasheet")
    assert gpu == (989.0, "datasheet")  # a GPU's datasheet peak is not measured: above it is a counting bug


def test_checkpointing_asked_for_is_not_cached_as_one_the_probe_needed():
    """The batch probe's cache records checkpointing that the measurements turned on; one the user asked for is
    the run's own row ("asked for"), and a cached run must not add a second one saying micro batch 1 did not fit."""
    from tunebench.model import models
    from tunebench.training.autotune import batch
    from tunebench.training.autotune.probe import enable_checkpointing

    def step(size):
        return 100.0 * size, 1000.0 + size

    cpu = torch.device("cpu")
    shape = dataclasses.replace(_shape("asked-on"), gradient_checkpointing="on")
    for _ in range(2):  # measured, then from the cache
        step.model = models.resolve("tiny").model
        enable_checkpointing(step.model)  # as runplan.measure does when it is asked for
        micro, rows, _ = batch.probed_micro_batch(step, shape, 4, 100, 256, cpu)
        assert micro == 4 and [r[0] for r in rows] == ["micro_batch_size"], rows


def test_a_runtime_beside_torch_takes_torchs_thread_share(monkeypatch):
    """llama.cpp's answers and quantizer take hardware.cpu_threads(): OMP_NUM_THREADS where it is set (a test
    worker's share of the cores), else the physical cores this process may use, never the host's CPU count."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert hardware.cpu_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    hw = hardware.detect()
    assert hardware.cpu_threads() == hardware._pick_threads(None, hw, None).value <= (hw.usable_cpus or hw.logical_cores)
