"""`tunebench hw`: what this machine is and what tunebench would pick on it, with reasons."""

from __future__ import annotations

import functools
import json

from tunebench import hardware, runplan, summary
from tunebench.config import load_config
from tunebench.hardware import Decision
from tunebench.models import cache_dir


def profile_for(hw) -> tuple[str, str]:
    """(the shipped profile for this machine, why): by GPU memory class, else the CPU one."""
    if not hw.gpus:
        return "cpu", "no GPU visible"
    gib = hw.gpus[0].memory_mb / 1024
    name = "gpu-8-12gb" if gib < 16 else "gpu-24gb" if gib < 40 else "gpu-80gb"
    return name, f"{hw.gpus[0].name} has {gib:.0f} GiB"


def system_info(hw, record: dict) -> str:
    """The study's system_info.txt: date, CPU, GPU, CUDA and package versions, one fact a line."""
    import datetime
    import platform

    lines = [f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"host: {platform.node()}", f"os: {hw.os}", f"python: {platform.python_version()}",
             f"cpu: {hw.cpu_model} ({hw.physical_cores} physical / {hw.logical_cores} logical cores)",
             f"cpu features: {', '.join(sorted(hw.cpu_flags & set(hardware.CPU_FEATURES))) or 'none of note'}",
             f"ram: {hw.ram_total_mb / 1024:.1f} GiB"]
    lines += [f"gpu {g.index}: {g.name}, {g.memory_mb / 1024:.1f} GiB, sm_{g.capability[0]}{g.capability[1]}"
              for g in hw.gpus] or ["gpu: none"]
    lines += [f"cuda: {hw.cuda_version or 'none'}", f"driver: {hw.driver_version or 'none'}"]
    lines += [f"{k}: {v}" for k, v in hw.versions.items()]
    lines += [f"recommended {d['setting']}: {d['value']} ({d['reason']})" for d in record["decisions"]]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=1)
def machine():
    """(this machine, the plan tunebench would make on it, its record: hardware, that plan, the peak MFU is
    against), detected once per process."""
    hw = hardware.detect()
    plan = hardware.plan("auto", "auto", hw)
    peak, source = hardware.peak_tflops(plan.device, plan.precision, hw, plan.threads, cache_dir() / "peak_flops.json")
    return hw, plan, {"hardware": hw.to_dict(), **plan.to_dict(), "peak_tflops": peak, "peak_tflops_source": source}


def run(as_json: bool = False, text: str | None = None) -> dict:
    hw, plan, record = machine()
    peak, source = record["peak_tflops"], record["peak_tflops_source"]
    if as_json:
        print(json.dumps(record, indent=2))
        return record
    if text is not None:
        from tunebench.durable import atomic_file

        with atomic_file(text) as tmp:
            tmp.write_text(system_info(hw, record))
        print(f"wrote {text}")
        return record
    print(f"CPU       {hw.cpu_model}: {hw.physical_cores} physical / {hw.logical_cores} logical cores")
    print(f"features  {', '.join(sorted(hw.cpu_flags & set(hardware.CPU_FEATURES))) or 'none of note'}")
    print(f"RAM       {hw.ram_total_mb / 1024:.1f} GiB total, {hw.ram_available_mb / 1024:.1f} GiB available")
    print(f"OS        {hw.os}")
    for g in hw.gpus:
        print(f"GPU {g.index}     {g.name}, {g.memory_mb / 1024:.1f} GiB, sm_{g.capability[0]}{g.capability[1]}, "
              f"bf16 {'yes' if g.bf16 else 'no'}, TF32 {'yes' if g.tf32 else 'no'}; "
              f"driver {hw.driver_version or '?'}, CUDA {hw.cuda_version or '?'}")
    if hw.mps:
        print("MPS       available")
    print("versions  " + ", ".join(f"{k} {v}" for k, v in hw.versions.items()))
    print(f"peak      {f'{peak:.2f} TFLOP/s' if peak else 'n/a'} ({source}); MFU is reported against it")
    # The batch as `tunebench train` would plan it on defaults, by the rule every run uses (runplan).
    effective = load_config().batch_ask().check(1)
    sizes = runplan.micro_candidates(effective, 1, effective)
    rows = [*plan.decisions, Decision("micro_batch_size", "auto", f"measured on the run's model: {', '.join(map(str, sizes))} "
                                      f"(the divisors of the effective batch {effective})"),
            Decision("effective_batch_size", effective, "--effective-batch-size default; = micro x accumulation "
                                                        "x ranks")]
    summary.print_plan(rows, "recommended:")
    profile, why = profile_for(hw)
    print(f"\nrun it ({why}; the micro batch is measured on the run's own model, within the memory free):\n"
          f"  tunebench train --profile {profile} --precision {plan.precision} --batch-size auto")
    return record
