"""`tunebench hw`: what this machine is and what tunebench would pick on it, with reasons."""

from __future__ import annotations

import json

from tunebench import hardware, runplan, summary
from tunebench.config import load_config
from tunebench.hardware import Decision
from tunebench.models import cache_dir


def run(as_json: bool = False) -> dict:
    hw = hardware.detect()
    plan = hardware.plan("auto", "auto", hw)
    peak, source = hardware.peak_tflops(plan.device, plan.precision, hw, plan.threads, cache_dir() / "peak_flops.json")
    record = {"hardware": hw.to_dict(), **plan.to_dict(), "peak_tflops": peak, "peak_tflops_source": source}
    if as_json:
        print(json.dumps(record, indent=2))
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
    return record
