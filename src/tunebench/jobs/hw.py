"""`tunebench hw`: what this machine is and what tunebench would pick on it, with reasons."""

from __future__ import annotations

import datetime
import functools
import json
import platform
from pathlib import Path

from tunebench.core.batch_rule import micro_candidates
from tunebench.core.decision import Decision
from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_json
from tunebench.core.precision import DTYPES
from tunebench.machine import cpuspeed, hardware
from tunebench.model import models
from tunebench.model.models import cache_dir
from tunebench.settings.finetune import load_config
from tunebench.training import autotune, runplan, summary
from tunebench.training.autotune import known, memory


def profile_for(hw) -> tuple[str, str]:
    """(the shipped profile for this machine, why): by GPU memory class, else the CPU one."""
    if not hw.gpus:
        return "cpu", ("Apple MPS: no MPS profile ships, so the CPU one's starting points" if hw.mps
                       else "no GPU visible")
    gib = hw.gpus[0].memory_mb / 1024
    name = "gpu-8-12gb" if gib < 16 else "gpu-24gb" if gib < 40 else "gpu-80gb"
    return name, f"{hw.gpus[0].name} has {gib:.0f} GiB"


def system_info(hw, record: dict) -> str:
    """The study's system_info.txt: date, CPU, GPU, CUDA and package versions, one fact a line."""
    lines = [f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"host: {platform.node()}", f"os: {hw.os}", f"python: {platform.python_version()}",
             f"cpu: {hw.cpu_model} ({hw.physical_cores} physical / {hw.logical_cores} logical cores)",
             f"cpu features: {', '.join(sorted(hw.cpu_flags & set(cpuspeed.CPU_FEATURES))) or 'none of note'}",
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


def recommend(hw: hardware.Hardware, plan: hardware.Plan) -> tuple[list[Decision], str]:
    """What tunebench picks on `hw` before any model is measured: the hardware plan's rows, the batch rule on
    the defaults, the peak MFU is reported against, the logging interval, the profile, and the `tunebench
    train` command it recommends."""
    effective = load_config().batch_ask().check(1)
    sizes = micro_candidates(effective, 1, effective)
    profile, why = profile_for(hw)
    rows = [*plan.decisions, *starts_from(hw, plan, sizes, effective),
            Decision("effective_batch_size", effective, "--effective-batch-size default; = micro x accumulation "
                                                        "x ranks"),
            peak_row(plan, hw), runplan.logging_row(None, plan.device), Decision("profile", profile, why)]
    return rows, f"tunebench train --profile {profile} --precision {plan.precision} --batch-size auto"


# The study's shape: SmolLM2-135M-Instruct (the default model) with LoRA at 128 tokens.
STUDY = (134_515_008, 128, "lora")


def starts_from(hw: hardware.Hardware, plan: hardware.Plan, sizes: list[int], effective: int) -> list[Decision]:
    """The attention and micro batch rows of the study's shape on `hw`: what `auto` measures first and predicts
    from, by the nearest machine class's record of the run's precision (autotune.known), or plain measuring."""
    candidates = ", ".join(map(str, sizes))
    k = known.nearest(known.shipped(), known.unit(hw.cpu_flags), plan.precision, plan.threads, *STUDY) \
        if plan.device == "cpu" else None
    if k is None:
        why = (f"no record of {plan.precision} CPUs ships" if plan.device == "cpu" else f"no record of {plan.device} "
               "machines ships")
        return [Decision("attention", "auto", f"measured on the run's model ({why})"),
                Decision("micro_batch_size", "auto", f"measured on the run's model: {candidates} (the divisors of "
                                                     f"the effective batch {effective}), smallest first ({why})")]
    o = k.outcome
    order = k.kernel_order(tuple(o.attention))
    first = k.best_micro(sizes)
    return [Decision("attention", "auto", f"{order[0]} measured first; the others while the record's ratios say "
                     "they could repay it: " + ", ".join(f"{n} {o.attention[n]:,.0f}" for n in order)
                     + f" tokens/s on {k.source}"),
            Decision("micro_batch_size", "auto", f"{first} measured first, of {candidates} (the divisors of the "
                     f"effective batch {effective}); the others while they could save more than measuring costs, "
                     "else predicted: " + ", ".join(f"{m} {v:,.0f}" for m, v in sorted(o.micro_batch.items()))
                     + f" tokens/s on {k.source}")]


def peak_row(plan: hardware.Plan, hw: hardware.Hardware) -> Decision:
    """The peak MFU is reported against, as far as it follows from the machine: a GPU's datasheet figure; a
    CPU's is measured on the CPU itself (its FMA limit, where the clock and vector width are known, caps it)."""
    if plan.device == "cuda":
        peak, source = hardware.peak_tflops(plan.device, plan.precision, hw, plan.threads, None)
        return Decision("peak_tflops", peak, source)
    if plan.device == "cpu":
        limit, how = hardware.fma_limit_tflops(plan.precision, hw, plan.threads)
        return Decision("peak_tflops", "measured", f"the best {plan.precision} matmul, measured once on this CPU; "
                        + (f"FMA limit {limit:.3f} TFLOP/s ({how})" if limit else how))
    return Decision("peak_tflops", None, f"no peak figure for {plan.device}: MFU is not reported")


def memory_row(hw: hardware.Hardware, plan: hardware.Plan, model: str, method: str, max_length: int,
               runtime_mb: float) -> Decision:
    """What training `model` with `method` would take on `hw` at its smallest (micro batch 1, checkpointing on),
    from the model's config alone: the memory plan, or the refusal a run would meet before loading."""
    config = models.config_of(model)
    if config is None:
        raise TunebenchError(f"--model '{model}': no config to plan from; give a model directory, a hub id in the "
                             "cache, or a config.json")
    gpu = plan.device == "cuda" and hw.gpus
    free = 0.92 * hw.gpus[0].memory_mb if gpu else 0.8 * hw.ram_available_mb  # as the batch probe leaves room
    shape = memory.on_meta(config)
    named = Path(model).name if model.endswith(".json") else model  # a config file: its name, not where it lies
    smallest, refused = memory.check_fits(shape, f"{named} with --method {method}", method,
                                          DTYPES[plan.precision].itemsize, load_config().adapter.r, "auto",
                                          max_length, free, plan.device, 0.0 if gpu else runtime_mb)
    where = f"{hw.gpus[0].name}'s {free / 1024:.1f} GB" if gpu else f"{free / 1024:.1f} GB of RAM"
    if refused:
        return Decision("memory_plan", "does not fit", refused)
    return Decision("memory_plan", f"{smallest.total / 1024:.1f} GB", f"{method} on {shape.params / 1e9:.2f}B "
                    f"parameters at its smallest step: {smallest.parts()}; fits {where}")


def recorded(path: str, model: str | None = None, method: str = "lora",
             max_length: int = 128) -> tuple[hardware.Hardware, list[Decision], str]:
    """(the machine, the settings tunebench would pick there, the command) from the record `tunebench hw
    --json` wrote on it. Planned as a fresh command there would be (no OMP_NUM_THREADS or torchrun ranks of
    this process); the allocator row is left out: it says what this planning process does with freed memory,
    not the recorded machine."""
    hw = load_record(path)
    plan = hardware.plan("auto", "auto", hw, env={})
    rows, command = recommend(hw, plan)
    if model:  # the recorded machine's runtime is not known here: a CPU's is planned at this process's
        rows.append(memory_row(hw, plan, model, method, max_length, RECORDED_RUNTIME_MB))
    return hw, [r for r in rows if r.setting != "allocator"], command


RECORDED_RUNTIME_MB = 500.0  # Python, torch, transformers, a tokenizer and data: 480-490 MB at training starts here


def load_record(path: str) -> hardware.Hardware:
    """A machine record (`tunebench hw --json` on that machine), read and checked."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TunebenchError(f"--machine '{path}' cannot be read as JSON ({getattr(e, 'strerror', None) or e}); "
                             "give a file `tunebench hw --json` wrote") from None
    if not isinstance(record, dict):
        raise TunebenchError(f"--machine '{path}' is not a machine record; give a file `tunebench hw --json` wrote")
    try:
        return hardware.from_record(record)
    except (KeyError, TypeError, ValueError) as e:
        raise TunebenchError(f"--machine '{path}' is not a machine record ({e}); give a file `tunebench hw --json` "
                             "wrote") from None


def write_record(path: str, precision: str = "auto") -> dict:
    """`tunebench hw --record FILE`: this machine's measured outcomes (the measurement cache's complete probes at
    `precision`) in the shipped records' format (autotune.known), for a user to contribute a machine class."""

    hw, plan, _ = machine()
    precision = plan.precision if precision == "auto" else precision
    date = datetime.date.today().isoformat()
    record = known.from_cache(read_json(autotune.cache_file()), hw.cpu_model, plan.threads, hw.cpu_flags, precision,
                              f"tunebench hw --record on {hw.cpu_model}, {plan.threads} threads, {date}: the "
                              "measurement cache's complete probes")
    if record is None:
        raise TunebenchError(f"no complete measurement of this machine in {precision} is on record in "
                             f"{autotune.cache_file()}; train once with --measure full (and --precision {precision}), "
                             "then record")
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record.to_dict(), indent=2) + "\n")
    print(f"wrote {path}: {record.label}, {len(record.outcomes)} shape(s) measured ("
          + "; ".join(f"{o.model} {o.method} at {o.max_length} tokens: micro "
                      + ", ".join(f"{m} {v:,.0f}" for m, v in sorted(o.micro_batch.items())) + " tokens/s"
                      for o in record.outcomes) + ")")
    return record.to_dict()


def run(as_json: bool = False, text: str | None = None, machine_record: str | None = None, model: str | None = None,
        method: str = "lora", max_length: int = 128, record_to: str | None = None, precision: str = "auto") -> dict:
    if record_to is not None:
        return write_record(record_to, precision)
    if machine_record is not None:  # another machine's decisions, planned here from its record
        hw, rows, command = recorded(machine_record, model, method, max_length)
        print(f"recorded machine {machine_record}: {hw.cpu_model}, {hw.physical_cores} physical cores"
              + "".join(f"; GPU {g.index} {g.name}, {g.memory_mb / 1024:.0f} GiB" for g in hw.gpus)
              + ("; Apple MPS" if hw.mps else ""))
        summary.print_plan(rows, "tunebench would pick there:")
        print(f"\nrun it there:\n  {command}")
        return {"hardware": hw.to_dict(), "decisions": [d._asdict() for d in rows]}
    hw, plan, record = machine()
    peak, source = record["peak_tflops"], record["peak_tflops_source"]
    if as_json:
        print(json.dumps(record, indent=2))
        return record
    if text is not None:

        with atomic_file(text) as tmp:
            tmp.write_text(system_info(hw, record))
        print(f"wrote {text}")
        return record
    print(f"CPU       {hw.cpu_model}: {hw.physical_cores} physical / {hw.logical_cores} logical cores")
    print(f"features  {', '.join(sorted(hw.cpu_flags & set(cpuspeed.CPU_FEATURES))) or 'none of note'}")
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
    rows, command = recommend(hw, plan)
    if model:

        rows.append(memory_row(hw, plan, model, method, max_length, memory.runtime_mb(plan.device)))
    summary.print_plan([r for r in rows if r.setting not in ("peak_tflops", "profile")], "recommended:")
    profile, why = profile_for(hw)
    print(f"\nrun it ({why}; the micro batch is measured on the run's own model, within the memory free):\n"
          f"  {command}")
    return record
