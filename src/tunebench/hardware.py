"""What machine is this, and what should a run on it use? Every answer comes with its reason.

`detect()` reads the machine; `plan()` turns (requested settings, machine) into decisions.
Both are pure enough to test from fixtures: `plan` takes a `Hardware` record, not the machine.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

from tunebench.errors import TunebenchError

# CPU flags (as /proc/cpuinfo names them) that matter for training throughput.
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


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
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def cpu_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_flags"] = sorted(self.cpu_flags & set(CPU_FEATURES))
        d["gpus"] = [dict(asdict(g), bf16=g.bf16, tf32=g.tf32) for g in self.gpus]
        return d


@dataclass(frozen=True)
class Decision:
    setting: str
    value: object
    reason: str


@dataclass(frozen=True)
class Plan:
    device: str
    precision: str  # fp32 | bf16 | fp16
    threads: int
    decisions: tuple[Decision, ...]

    def to_dict(self) -> dict:
        return {"decisions": [asdict(d) for d in self.decisions]}


def _cpu_info() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def _versions() -> dict[str, str]:
    from importlib import metadata

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
    mem = psutil.virtual_memory()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GPU(i, p.name, p.total_memory // 2**20, (p.major, p.minor)))
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Hardware(
        cpu_model=model,
        physical_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        cpu_flags=flags,
        ram_total_mb=mem.total // 2**20,
        ram_available_mb=mem.available // 2**20,
        os=f"{platform.system()} {platform.release()}",
        gpus=tuple(gpus),
        mps=mps,
        versions=_versions(),
    )


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


def _pick_precision(requested: str, device: str, hw: Hardware) -> Decision:
    gpu = hw.gpus[0] if device == "cuda" and hw.gpus else None
    if requested == "fp16" and device == "cpu":
        raise TunebenchError("--precision fp16 is for GPUs; on a CPU use bf16 (if supported) or fp32")
    if requested == "bf16":
        if gpu is not None and not gpu.bf16:
            raise TunebenchError(
                f"--precision bf16 needs an Ampere or newer GPU; {gpu.name} (sm_{gpu.capability[0]}"
                f"{gpu.capability[1]}) lacks it: use --precision fp16 or auto"
            )
        if device == "cpu" and not hw.cpu_bf16:
            raise TunebenchError(
                "--precision bf16 on this CPU has no AVX512-BF16 or AMX-BF16 and would run emulated, "
                "slower than fp32; use --precision fp32 or auto"
            )
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
        return Decision("precision", "bf16", "CPU has AVX512-BF16")
    return Decision("precision", "fp32", "CPU has no native bf16 (no AVX512-BF16 or AMX)")


def plan(device: str, precision: str, hw: Hardware) -> Plan:
    """Decide device, precision and threads for a run; a forced impossible setting raises."""
    dev = _pick_device(device, hw)
    prec = _pick_precision(precision, str(dev.value), hw)
    threads = Decision(
        "torch_threads", hw.physical_cores, f"{hw.physical_cores} physical cores; hyper-threads add no matmul throughput"
    )
    return Plan(str(dev.value), str(prec.value), int(threads.value), (dev, prec, threads))
