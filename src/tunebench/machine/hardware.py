"""What machine is this, and what should a run on it use? Every answer comes with its reason.

`detect()` reads the machine; `plan()` turns (requested settings, machine) into decisions.
Both are pure enough to test from fixtures: `plan` takes a `Hardware` record, not the machine.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from tunebench.core import startup
from tunebench.core.decision import Decision, value_of
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_json, update_json
from tunebench.machine import cpuspeed

# Dense peak TFLOP/s (no sparsity; FP32 accumulate for fp16/bf16 tensor math), from the vendors'
# datasheets and architecture whitepapers. Matched against the CUDA device name, first hit wins,
# so more specific names come first. A GPU not listed gets MFU "n/a", never a guess.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("A10G", {}),  # AWS variant without published dense tensor figures: unknown, not A10's
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("RTX 5090", {"bf16": 209.5, "fp16": 209.5, "tf32": 104.8, "fp32": 104.8}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 4080", {"bf16": 97.5, "fp16": 97.5, "tf32": 48.7, "fp32": 48.7}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    ("RTX 3080", {"bf16": 59.5, "fp16": 59.5, "tf32": 29.8, "fp32": 29.8}),
    ("RTX 3070", {"bf16": 40.6, "fp16": 40.6, "tf32": 20.3, "fp32": 20.3}),
    ("RTX 3060", {"bf16": 25.4, "fp16": 25.4, "tf32": 12.7, "fp32": 12.7}),
    ("RTX 2080 Ti", {"fp16": 53.8, "fp32": 13.4}),
    ("1080 Ti", {"fp16": 0.18, "fp32": 11.3}),  # Pascal: no tensor cores, fp16 at 1/64 rate
)


def gpu_peak_tflops(name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a GPU for `dtype` (fp32, tf32, fp16, bf16), or None when unknown."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_mb: int
    capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.capability >= (8, 0)


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    cpu_flags: frozenset[str]
    ram_total_mb: int
    ram_available_mb: int
    os: str
    gpus: tuple[GPU, ...] = ()
    mps: bool = False
    cuda_version: str | None = None
    driver_version: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    usable_cpus: int | None = None  # logical CPUs this process may run on (its affinity mask); None: all
    cpu_mhz: float | None = None  # the highest clock reported (cpufreq's maximum, else /proc/cpuinfo); None: unknown
    cpu_quota: float | None = None  # CPUs' worth of time a cgroup quota allows (a container's --cpus); None: no quota
    # bf16 matmuls' speed over fp32's at a training step's shapes, measured (bf16_over_fp32) where the CPU's bf16 is
    # AVX512-BF16 without AMX, the one class where the flags do not say which is faster; None: not measured
    bf16_over_fp32: float | None = None

    @property
    def cpu_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_flags"] = sorted(self.cpu_flags & set(cpuspeed.CPU_FEATURES))
        d["gpus"] = [dict(asdict(g), bf16=g.bf16, tf32=g.tf32) for g in self.gpus]
        return d


def from_record(record: dict) -> Hardware:
    """The machine of a record `tunebench hw --json` wrote (its "hardware", or the bare dict): what another
    machine's decisions are planned from, here."""
    d = dict(record.get("hardware", record))
    known = {f.name for f in fields(Hardware)}
    unknown = set(d) - known
    if unknown or not {"cpu_model", "physical_cores", "logical_cores", "cpu_flags"} <= set(d):
        raise TunebenchError(f"not a machine record of `tunebench hw --json` (unknown keys: {', '.join(sorted(unknown)) or 'none'}, "
                             "needs cpu_model, physical_cores, logical_cores, cpu_flags); write one with tunebench hw --json")
    d["cpu_flags"] = frozenset(d["cpu_flags"])
    d["gpus"] = tuple(GPU(g["index"], g["name"], g["memory_mb"], tuple(g["capability"])) for g in d.get("gpus", ()))
    d["versions"] = dict(d.get("versions") or {})
    return Hardware(**d)


@dataclass(frozen=True)
class Plan:
    device: str
    precision: str  # fp32 | bf16 | fp16
    threads: int
    decisions: tuple[Decision, ...]

    def value(self, setting: str, default=None):
        return value_of(self.decisions, setting, default)

    def decision(self, setting: str) -> Decision:
        return next(d for d in self.decisions if d.setting == setting)

    def to_dict(self) -> dict:
        return {"decisions": [d._asdict() for d in self.decisions]}


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """(model name, feature flags) from /proc/cpuinfo text (x86 'flags' or Arm 'Features')."""
    model, flags = None, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def _cpu_info() -> tuple[str, frozenset[str]]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = None, frozenset()
    return model or platform.processor() or platform.machine(), flags


def parse_cpu_quota(cpu_max: str | None = None, cfs_quota: str | None = None, cfs_period: str | None = None):
    """CPUs' worth of time a cgroup allows, from cgroup v2's cpu.max ("200000 100000", or "max 100000") or
    v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none). None when there is no quota."""
    try:
        if cpu_max is not None:
            quota, period = cpu_max.split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if cfs_quota is not None and cfs_period is not None and int(cfs_quota) > 0:
            return int(cfs_quota) / int(cfs_period)
    except (ValueError, IndexError, ZeroDivisionError):
        pass
    return None


def _cgroup_cpu_quota() -> float | None:
    """The tightest CPU quota over this process's cgroup and its container root (Linux only)."""
    root = Path("/sys/fs/cgroup")
    try:
        own = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    except OSError:
        own = []
    quotas = []
    for _, controllers, rel in own:
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            for d in {root / rel, root}:
                if (d / "cpu.max").is_file():
                    quotas.append(parse_cpu_quota((d / "cpu.max").read_text()))
        elif "cpu" in controllers.split(","):
            for d in {root / "cpu" / rel, root / "cpu", root / "cpu,cpuacct" / rel, root / "cpu,cpuacct"}:
                if (d / "cpu.cfs_quota_us").is_file():
                    quotas.append(parse_cpu_quota(None, (d / "cpu.cfs_quota_us").read_text(),
                                                  (d / "cpu.cfs_period_us").read_text()))
    found = [q for q in quotas if q]
    return min(found) if found else None


def usable_cpus() -> int | None:
    """The cores this process may run on (its affinity); None where the system does not say."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _versions() -> dict[str, str]:

    out = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def detect() -> Hardware:
    import psutil
    import torch

    model, flags = _cpu_info()
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    usable, versions = usable_cpus(), _versions()
    mem = psutil.virtual_memory()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GPU(i, p.name, p.total_memory // 2**20, (p.major, p.minor)))
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    driver = None
    if gpus:
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:  # nvidia-ml-py missing or NVML unavailable: the version is only informative
            driver = None
    return Hardware(
        cpu_model=model,
        physical_cores=cores,
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        cpu_flags=flags,
        ram_total_mb=mem.total // 2**20,
        ram_available_mb=mem.available // 2**20,
        os=f"{platform.system()} {platform.release()}",
        gpus=tuple(gpus),
        mps=mps,
        cuda_version=torch.version.cuda if gpus else None,
        driver_version=driver,
        versions=versions,
        usable_cpus=usable,
        cpu_quota=_cgroup_cpu_quota(),
        cpu_mhz=_cpu_mhz(psutil),
        bf16_over_fp32=cpuspeed.bf16_over_fp32(model, flags, min(cores, usable or cores), versions.get("torch")),
    )


def _cpu_mhz(psutil) -> float | None:
    """The highest clock the OS reports: cpufreq's maximum where it has one (bare metal), else the
    'cpu MHz' of /proc/cpuinfo (a VM's nominal clock)."""
    try:
        top = (psutil.cpu_freq() or None) and psutil.cpu_freq().max
    except (OSError, AttributeError, NotImplementedError):
        top = None
    if top:
        return float(top)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            mhz = [float(v) for line in f if line.startswith("cpu MHz") for v in [line.partition(":")[2]]]
    except (OSError, ValueError):
        return None
    return max(mhz) if mhz else None


def _pick_device(requested: str, hw: Hardware) -> Decision:
    if requested == "cuda" and not hw.gpus:
        raise TunebenchError("--device cuda was asked for, but no CUDA GPU is visible; use --device auto or cpu")
    if requested == "mps" and not hw.mps:
        raise TunebenchError("--device mps was asked for, but Apple MPS is not available; use --device auto or cpu")
    if requested != "auto":
        return Decision("device", requested, "asked for")
    if hw.gpus:
        return Decision("device", "cuda", f"CUDA GPU present: {hw.gpus[0].name}")
    if hw.mps:
        return Decision("device", "mps", "Apple MPS present")
    return Decision("device", "cpu", "no GPU visible")


def cpu_native(precision: str, hw: Hardware) -> bool:
    """Whether this CPU has units for `precision`'s matmuls (fp32 always; bf16 with AVX512-BF16 or AMX-BF16;
    fp16 with AMX-FP16). Elsewhere torch emulates 16-bit math on the fp32 units."""
    return precision == "fp32" or (precision == "bf16" and hw.cpu_bf16) or \
        (precision == "fp16" and "amx_fp16" in hw.cpu_flags)


def _pick_precision(requested: str, device: str, hw: Hardware) -> Decision:
    gpu = hw.gpus[0] if device == "cuda" and hw.gpus else None
    if requested == "bf16" and gpu is not None and not gpu.bf16:
        raise TunebenchError(
            f"--precision bf16 needs an Ampere or newer GPU; {gpu.name} (sm_{gpu.capability[0]}"
            f"{gpu.capability[1]}) lacks it: use --precision fp16 or auto"
        )
    if device == "cpu" and requested in ("bf16", "fp16"):
        # A CPU computes every dtype; without the units for it, torch emulates it (slower than fp32). It is
        # run as asked, and said: a machine without native bf16 still runs the path machines with it take.
        how = "native on this CPU" if cpu_native(requested, hw) else (
            f"emulated: this CPU has no {'AVX512-BF16 or AMX-BF16' if requested == 'bf16' else 'AMX-FP16'}, "
            "so it runs slower than fp32")
        how += "; fp16 with a GradScaler" if requested == "fp16" else ""
        return Decision("precision", requested, f"asked for ({how})")
    if requested != "auto":
        return Decision("precision", requested, "asked for")
    if gpu is not None:
        if gpu.bf16:
            return Decision("precision", "bf16", f"{gpu.name} has bf16 tensor cores (sm_{gpu.capability[0]}x)")
        return Decision("precision", "fp16", f"{gpu.name} lacks bf16; fp16 with a GradScaler")
    if device == "mps":
        return Decision("precision", "fp32", "MPS autocast to bf16 is not reliable for training")
    if "amx_bf16" in hw.cpu_flags:
        return Decision("precision", "bf16", "CPU has AMX-BF16 tile units")
    if "avx512_bf16" in hw.cpu_flags:
        x = hw.bf16_over_fp32
        if x is not None and x < 1.0:
            return Decision("precision", "fp32", f"CPU has AVX512-BF16 but no AMX, and a step's matmuls measured "
                                                 f"{x:.2f}x as fast in bf16 as in fp32 here: fp32 trains faster")
        return Decision("precision", "bf16", "CPU has AVX512-BF16" + (
            f" (no AMX): a step's matmuls measured {x:.2f}x as fast in bf16 as in fp32 here" if x is not None else ""))
    return Decision("precision", "fp32", "CPU has no native bf16 (no AVX512-BF16 or AMX)")


def _pick_threads(requested: int | None, hw: Hardware, omp_num_threads: str | None, local_ranks: int = 1,
                  launched_by_tunebench: bool = False) -> Decision:
    """Threads for torch's CPU work: asked for, else OMP_NUM_THREADS, else the physical cores this process
    may actually use (its affinity mask and cgroup quota: a container limited to 2 CPUs on a 64-core host
    must not start 64 threads that take turns), shared out among the ranks on this machine."""
    allowed = hw.usable_cpus or hw.logical_cores
    if requested is not None:
        if requested > allowed:
            raise TunebenchError(f"--threads {requested} is more than the {allowed} CPUs this process may use; pass "
                                 f"--threads {allowed} or less (or leave it unset to use the physical cores)")
        crowded = "" if requested * local_ranks <= allowed else \
            f"; {local_ranks} ranks x {requested} is more than the {allowed} CPUs here: threads will take turns"
        return Decision("torch_threads", requested, "asked for (--threads)" + crowded)
    if omp_num_threads and omp_num_threads.strip() and not launched_by_tunebench:
        first = omp_num_threads.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise TunebenchError(f"OMP_NUM_THREADS={omp_num_threads!r} is not a positive whole number; set it "
                                 "to e.g. 4, or unset it to let tunebench pick")
        torchrun = " (torchrun sets 1 when it is unset: use tunebench launch, or set it, for more)" \
            if local_ranks > 1 and first == "1" else ""
        return Decision("torch_threads", int(first), f"OMP_NUM_THREADS={first}{torchrun}")
    cores = hw.physical_cores
    reason = f"{cores} physical cores; hyper-threads add no matmul throughput"
    if allowed < hw.logical_cores:  # affinity: about the same share of the physical cores
        cores = max(1, min(cores, round(allowed * hw.physical_cores / hw.logical_cores)))
        reason = f"CPU affinity allows {allowed} of {hw.logical_cores} CPUs: {cores} physical cores' worth"
    if hw.cpu_quota is not None and int(hw.cpu_quota) < cores:
        cores = max(1, int(hw.cpu_quota))
        reason = f"the cgroup CPU quota allows {hw.cpu_quota:g} CPUs (of {hw.physical_cores} physical cores)"
    if local_ranks > 1:
        share = max(1, cores // local_ranks)
        return Decision("torch_threads", share, f"{reason}, shared by {local_ranks} ranks on this machine: "
                                                f"{cores} // {local_ranks}")
    return Decision("torch_threads", cores, reason)


def cpu_threads() -> int:
    """The threads a CPU runtime beside torch takes (llama.cpp's answers and its quantizer): torch's own rule
    (OMP_NUM_THREADS, else the physical cores this process may use), never os.cpu_count(), which counts the
    cores of the whole host: two such processes on 2 cores ran 10x slower than one."""
    return int(_pick_threads(None, detect(), os.environ.get("OMP_NUM_THREADS")).value)


def pick_parallel(requested: str, method: str, parameters: int, world_size: int, memory_mb: float) -> Decision:
    """How several ranks split the work. DDP keeps a whole replica (weights, gradients, AdamW moments:
    ~16 bytes a trainable parameter in fp32) on every rank and is the fastest where that fits; FSDP2
    shards all of it over the ranks, for full fine-tuning or pretraining of a model that does not fit
    one rank's `memory_mb`. LoRA's trainable part is small: its frozen base is what fills memory,
    and quantizing it (QLoRA) is the tool for that, so adapters always run under DDP."""
    if world_size == 1 and requested != "fsdp":
        return Decision("parallel", "none", "1 process")
    if method in ("lora", "qlora"):
        if requested == "fsdp":
            raise TunebenchError(f"--parallel fsdp shards full fine-tuning and pretraining; {method} trains small "
                                 "adapters: use --parallel ddp (or auto), and --method qlora to shrink the base")
        return Decision("parallel", "ddp", f"{method}: a replica per rank, adapters' gradients averaged")
    need = 16 * parameters / 2**20
    if requested != "auto":
        return Decision("parallel", requested, "asked for (--parallel)")
    if need > 0.6 * memory_mb:
        return Decision("parallel", "fsdp", f"a replica needs ~{need:,.0f} MB (weights, gradients, AdamW moments), "
                                            f"over 60% of the {memory_mb:,.0f} MB one rank may use: shard it")
    return Decision("parallel", "ddp", f"a replica (~{need:,.0f} MB with gradients and AdamW moments) fits each "
                                       f"rank's {memory_mb:,.0f} MB: DDP, no gathering of weights per layer")


def _pick_compile(requested: str, device: str) -> Decision:
    if requested == "on":
        return Decision("compile", True, "asked for")
    if requested == "off":
        return Decision("compile", False, "asked for")
    if device == "mps":
        return Decision("compile", False, "torch.compile training on MPS is not mature")
    return Decision("compile", "auto", "measured once the micro batch is chosen")


def plan(device: str, precision: str, hw: Hardware, compile: str = "auto", threads: int | None = None,
         env: dict[str, str] | None = None) -> Plan:
    """Decide every hardware setting of a run, each with its reason; a forced impossible one raises.
    `env` (default os.environ) is read for OMP_NUM_THREADS and for torchrun's LOCAL_WORLD_SIZE (ranks
    on this machine, which share its cores)."""
    env = os.environ if env is None else env
    dev = _pick_device(device, hw)
    on = str(dev.value)
    prec = _pick_precision(precision, on, hw)
    gpu = hw.gpus[0] if on == "cuda" and hw.gpus else None
    decisions = [dev, prec]
    local_ranks = int(env.get("LOCAL_WORLD_SIZE", "1")) if "RANK" in env else 1
    decisions.append(_pick_threads(threads, hw, env.get("OMP_NUM_THREADS"), local_ranks,
                                   env.get("TUNEBENCH_LAUNCHED") == "1"))
    if gpu is not None:
        decisions.append(Decision("tf32", gpu.tf32, "Ampere+ runs fp32 matmuls on TF32 tensor cores" if gpu.tf32
                                  else f"{gpu.name} has no TF32"))
        decisions.append(Decision("cudnn_benchmark", False, "a transformer has no convolutions for cuDNN to tune"))
    decisions.append(Decision("pin_memory", on == "cuda", "page-locked host batches copy to the GPU asynchronously"
                              if on == "cuda" else "no accelerator to copy to"))
    decisions.append(_pick_compile(compile, on))
    decisions.append(Decision("allocator", *startup.allocator()))
    by = {d.setting: d.value for d in decisions}
    return Plan(on, str(prec.value), int(by["torch_threads"]), tuple(decisions))


# fp32 FLOPs a core retires per cycle at best: two FMA pipes x vector lanes x 2 (multiply and add). AVX-512
# parts with a single FMA pipe (some Xeon Silver/Bronze, AMD Zen 4's double-pumped 256-bit units) reach
# half of the 64: their MFU then reads low, never above what the silicon can do.
FP32_FLOPS_PER_CYCLE = (("avx512f", 64), ("avx2", 32))


def fma_limit_tflops(dtype: str, hw: Hardware, threads: int) -> tuple[float | None, str]:
    """cores x clock x fp32 FLOPs per cycle, where the clock and the vector width are known; bf16 (AMX,
    AVX512-BF16 dot products) has no such simple figure, so it is measured only."""
    width = next((w for flag, w in FP32_FLOPS_PER_CYCLE if flag in hw.cpu_flags), None)
    if dtype != "fp32" or not width or not hw.cpu_mhz:
        return None, "no FMA limit: " + (f"{dtype} is measured only" if dtype != "fp32" else
                                         "unknown clock" if width else "unknown vector width")
    isa = "AVX-512" if width == 64 else "AVX2"
    return (threads * hw.cpu_mhz * 1e6 * width / 1e12,
            f"{threads} cores x {hw.cpu_mhz:,.0f} MHz x {width} fp32 FLOP/cycle ({isa} FMA)")


def cpu_peak_tflops(dtype: str, hw: Hardware, threads: int, cache_file) -> float:
    """The measured CPU peak, cached per (CPU, flags, threads, torch, dtype): measured once, a few seconds."""
    key = _cpu_peak_key(dtype, hw, threads)
    peak = read_json(cache_file).get(key)
    if not isinstance(peak, (int, float)):
        peak = cpuspeed.measure_cpu_peak_tflops(dtype, threads)
        update_json(cache_file, key, peak)
    return float(peak)


def cpu_math_dtype(precision: str, hw: Hardware) -> str:
    """The units a CPU does `precision`'s matmuls on, whose peak MFU is against: native 16-bit units have their
    own; emulated 16-bit math runs on the fp32 units, whose peak is the roofline then (measuring the emulated
    matmul instead put a QLoRA fp16 run at an MFU of 103%)."""
    return precision if cpu_native(precision, hw) else "fp32"


def _cpu_peak_key(dtype: str, hw: Hardware, threads: int) -> str:
    # roofline-fastest: not the averaged figure of earlier releases
    return cpuspeed.cpu_key(hw.cpu_model, hw.cpu_flags, threads, hw.versions.get("torch"), f"{dtype}|roofline-fastest")


def reached(device: str, precision: str, hw: Hardware, threads: int, cache_file, achieved: float | None,
            peak: float | None, source: str) -> tuple[float | None, str]:
    """(peak, source) once a run has reached `achieved` TFLOP/s. A CPU's peak is measured (a GPU's is its
    datasheet's), and a measurement can come out low: the model's own GEMMs then run above it, and MFU read
    103.6% on a 1.07B model. A ceiling cannot be below what a run reached, so the peak becomes that figure,
    said so, and is recorded for the next run of this CPU: MFU never exceeds 100%."""
    if device != "cpu" or peak is None or not achieved or achieved <= peak:
        return peak, source

    update_json(cache_file, _cpu_peak_key(cpu_math_dtype(precision, hw), hw, threads), achieved)
    return achieved, (f"this run's own {achieved:.3f} TFLOP/s, above the {peak:.3f} of the peak it was measured "
                      f"against ({source}), which was low: now this CPU's recorded peak")


def peak_tflops(device: str, precision: str, hw: Hardware, threads: int, cache_file) -> tuple[float | None, str]:
    """(peak TFLOP/s for this run's matmuls, where the figure comes from); None when unknown."""
    if device == "cuda" and hw.gpus:
        gpu = hw.gpus[0]
        dtype = "tf32" if precision == "fp32" and gpu.tf32 else precision
        peak = gpu_peak_tflops(gpu.name, dtype)
        return peak, f"{gpu.name} {dtype} datasheet peak" if peak else f"{gpu.name} is not in the peak table"
    if device == "cpu":
        dtype = cpu_math_dtype(precision, hw)
        measured = cpu_peak_tflops(dtype, hw, threads, cache_file)
        limit, how = fma_limit_tflops(dtype, hw, threads)
        if limit and limit >= measured:
            return limit, f"FMA limit: {how}; best measured {dtype} matmul {measured:.3f} TFLOP/s"
        return measured, (f"best measured {dtype} matmul of this CPU; "
                          + (f"above the {limit:.3f} TFLOP/s FMA limit of {how}, so the clock is higher than "
                             "reported" if limit else how))
    return None, f"no peak figure for {device}"
