"""What this CPU's matmuls reach, measured: the dense matmul peak a roofline is drawn against, and how much faster
a step's matmuls run in bf16 than in fp32 where the flags leave it open (AVX512-BF16 without AMX). Each figure is
kept per CPU, flags, threads and torch (`cpu_key`) in the cache file of the peaks; hardware.py reads them into its
record and its precision and MFU decisions.
"""

from __future__ import annotations

import time

from tunebench.core.jsonfile import read_json, update_json
from tunebench.core.paths import cache_dir

# CPU flags (as /proc/cpuinfo names them) that matter for training throughput.
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16", "amx_int8", "amx_tile")


def cpu_key(model: str, flags: frozenset[str], threads: int, torch_version: str | None, what: str) -> str:
    """A CPU measurement's key in the peaks' cache file: the CPU, its flags that matter, threads, torch, and what."""
    return f"{model}|{','.join(sorted(flags & set(CPU_FEATURES)))}|{threads}|{torch_version}|{what}"


# A LoRA step's matmuls on a frozen base layer (the forward and the input's gradient) at a small model's width and
# a micro batch's tokens: what bf16_over_fp32 times in each precision.
BF16_STEP_SHAPE = (512, 1024, 2816)  # tokens, in features, out features


def measure_bf16_over_fp32(threads: int, rounds: int = 5) -> float:
    """How much faster a step's matmuls run in bf16 (autocast over bf16 weights, as a LoRA run's frozen base) than in
    fp32 on this CPU: each precision's fastest of `rounds`, the two alternating. On AVX512-BF16 without AMX the answer
    is the part's: a 2-core AMD EPYC trained SmolLM2 at ~900 positions/s in bf16, and a 2-core Intel Xeon (model
    207, its VM showing no AMX) at 160-200 tokens/s in bf16 against 222-283 in fp32 (micro 4, 2026-12-03)."""
    import torch

    tokens, width, out = BF16_STEP_SHAPE
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g)
    weight = torch.randn(out, width, generator=g) / width**0.5
    weights = {False: weight, True: weight.to(torch.bfloat16)}
    fastest = {False: float("inf"), True: float("inf")}
    try:
        for round_ in range(rounds + 1):  # the first round warms each precision's kernels up and is not counted
            for bf16 in (False, True):
                start = time.perf_counter()
                inputs = x.detach().requires_grad_()
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    y = torch.nn.functional.linear(inputs, weights[bf16])
                y.float().sum().backward()
                took = time.perf_counter() - start
                if round_:
                    fastest[bf16] = min(fastest[bf16], took)
    finally:
        torch.set_num_threads(old)
    return round(fastest[False] / fastest[True], 3)


def bf16_over_fp32(model: str, flags: frozenset[str], threads: int, torch_version: str | None) -> float | None:
    """measure_bf16_over_fp32 where the CPU has AVX512-BF16 and no AMX (elsewhere None: AMX's tiles are faster,
    no bf16 unit is slower), once per CPU, thread count and torch: kept in the cache with the matmul peaks."""
    if "avx512_bf16" not in flags or "amx_bf16" in flags:
        return None
    cache = cache_dir() / "peak_flops.json"
    key = cpu_key(model, flags, threads, torch_version, "bf16-over-fp32")
    on_disk = read_json(cache).get(key)
    seen = on_disk if on_disk is not None else _BF16_MEASURED.get(key)
    if not isinstance(seen, (int, float)):
        seen = measure_bf16_over_fp32(threads)
    if on_disk != seen:
        update_json(cache, key, seen)
    _BF16_MEASURED[key] = seen  # a process that moves its cache (tests, a second TUNEBENCH_CACHE) measures once
    return float(seen)


_BF16_MEASURED: dict[str, float] = {}


PEAK_SIZES = (512, 1024, 2048, 3072, 4096, 6144)


def measure_cpu_peak_tflops(dtype: str, threads: int, seconds: float = 1.0) -> float:
    """Best dense matmul TFLOP/s this CPU reaches in `dtype`, the way a roofline is measured: square
    matmuls of growing size until two in a row no longer beat the best so far by 2% (small sizes stop at the
    cache and the threading overhead: 2 AVX2 cores reach 104 GFLOP/s at 1024, 148 at 3072). Each size counts
    its fastest matmul, as the probes count their fastest step: a busy or cold machine only slows one down.
    Averaged, and stopped at the first size that did not rise, a fresh process on 2 AMX cores measured 1.28
    TFLOP/s where the next three measured 1.92-2.37, and a 1.07B model's MFU read 61.8% against it."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    best, flat = 0.0, 0
    try:
        for n in PEAK_SIZES:
            a, b = torch.randn(n, n, dtype=torch_dtype), torch.randn(n, n, dtype=torch_dtype)
            a @ b  # warm-up: kernel selection, caches
            fastest, spent, iters = float("inf"), 0.0, 0
            while spent < seconds / 3 or iters < 2:
                start = time.perf_counter()
                a @ b
                took = time.perf_counter() - start
                fastest, spent, iters = min(fastest, took), spent + took, iters + 1
            rate = 2 * n**3 / fastest / 1e12
            flat = flat + 1 if rate < 1.02 * best else 0
            best = max(best, rate)
            if flat == 2:
                break  # stopped rising
    finally:
        torch.set_num_threads(old)
    return best
