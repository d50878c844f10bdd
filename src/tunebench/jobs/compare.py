"""`tunebench compare`: run a matrix of training experiments on the devices present, one CSV row per run.

Each experiment is `tunebench train` in its own process (clean peak-memory accounting; a crash or
an OOM is a row, not the end of the sweep). Rows are appended and flushed one at a time, and a
rerun skips what the CSV already holds, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunebench.core.durable import atomic_file, open_no_follow, repair_tail
from tunebench.core.errors import TunebenchError
from tunebench.jobs import children, report, run_report, sizing
from tunebench.model import quality
from tunebench.settings import finetune as finetune_config
from tunebench.settings import pretrain as pretrain_config
from tunebench.settings.finetune import load_config, read_yaml, shipped_yaml
from tunebench.settings.rundir import RunDir

MATRICES_DIR = Path(__file__).resolve().parents[1] / "configs" / "matrices"

# The results CSV schema, one row per run (documented in docs/RESULTS.md).
# A GRPO run's held-out figures (summary.json's names), before training and after; the episodes' where it ran in an
# environment. Columns an earlier results CSV lacks are added empty (upgrade).
EPISODE_COLUMNS = {"environment": "environment", "reward_before": "eval_reward_before", "reward": "eval_reward",
                   "episode_success_before": "eval_episodes/success_before",
                   "episode_success": "eval_episodes/success", "episode_turns": "eval_episodes/turns",
                   "episode_calls": "eval_episodes/calls", "episode_calls_ok": "eval_episodes/calls_ok"}

SCHEMA = [
    "experiment", "config", "repeat", "device", "device_name", "cores", "processes", "threads", "batch_size",
    "grad_accum",
    "effective_batch", "method", "quantization", "precision", "max_length", "samples", "steps",
    "duration_seconds", "measure_seconds", "predicted_seconds", "samples_per_s", "it_per_s", "tokens_per_s", "peak_memory_mb", "final_train_loss", "eval_loss", "mfu",
    *quality.TASK_SCORES,  # task quality (train.eval_generate > 0; the tool scores where rows offer tools)
    "objective", "reward_accuracy",  # sft, or dpo/orpo with the held-out pairs' reward accuracy
    *EPISODE_COLUMNS,  # grpo: the held-out reward before and after; in an environment, its episodes'
    "trainable_params", "torch_version", "transformers_version", "peft_version", "bitsandbytes_version", "hostname", "timestamp",
    "status", "message", "run_dir",
]


@dataclass(frozen=True)
class Experiment:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None  # None: every device present
    nproc: int = 1  # processes (ranks) the run is launched on, through tunebench launch


def matrix_path(spec: str) -> Path:
    return shipped_yaml(spec, MATRICES_DIR, "matrix")


EXPERIMENT_KEYS = ("name", "set", "devices", "nproc", "description")
DEVICES = ("cpu", "cuda", "mps")
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+,@-]{0,119}$")  # a file name in the runs directory


def load_matrix(spec: str, extra: dict[str, Any] | None = None,
                nproc: list[int] | None = None) -> tuple[dict[str, Any], list[Experiment]]:
    """(base overrides, experiments) from a matrix YAML: `experiments:` (a list) and/or `grid:` (a product).
    `nproc` (an experiment's key beside `set`, or a grid dimension) is the number of processes.
    Everything is checked before anything runs: known keys only, devices a list of known ones,
    unique names that are safe as directory names, and every experiment's settings (with `extra`, the
    command line's, on top of the base) a valid run."""
    raw = read_yaml(matrix_path(spec))
    unknown = set(raw) - {"base", "experiments", "grid", "description", "budget"}
    if unknown:
        raise TunebenchError(f"matrix {spec}: unknown section(s) {', '.join(sorted(unknown))}; "
                             "use base, experiments, grid, budget")
    base = canonical("train", _mapping(raw.get("base"), f"matrix {spec}: base"))
    if sizing.budget_seconds(raw.get("budget"), spec) is not None and "data.max_samples" in base:
        raise TunebenchError(f"matrix {spec}: budget sizes data.max_samples to this machine; drop one of them")
    base |= canonical("train", dict(extra or {}))  # the command line's on top
    experiments = []
    if not isinstance(raw.get("experiments") or [], list):
        raise TunebenchError(f"matrix {spec}: experiments must be a list of {{name: ..., set: {{...}}}}")
    for e in raw.get("experiments") or []:
        if not isinstance(e, dict) or "name" not in e:
            raise TunebenchError(f"matrix {spec}: every experiment needs a name, got {e!r}")
        name = str(e["name"])
        extra = sorted(set(e) - set(EXPERIMENT_KEYS))
        if extra:
            hint = difflib.get_close_matches(extra[0], EXPERIMENT_KEYS, n=1)
            raise TunebenchError(f"matrix {spec}, experiment '{name}': unknown key '{extra[0]}'"
                                 + (f"; did you mean '{hint[0]}'?" if hint else f"; use {', '.join(EXPERIMENT_KEYS)}"))
        if not SAFE_NAME.match(name):
            raise TunebenchError(f"matrix {spec}: experiment name {name!r} must be letters, digits and ._=+,@- "
                                 "(it names a directory under the runs directory), starting with a letter or digit")
        try:
            chosen = canonical("train", _mapping(e.get("set"), f"matrix {spec}, experiment '{name}': set"))
        except TunebenchError as err:
            raise TunebenchError(f"matrix {spec}, experiment '{name}': {err}") from err
        experiments.append(Experiment(name, chosen,
                                      _devices(e.get("devices"), spec, name), _nproc(e.get("nproc", 1), spec)))
    grid = _mapping(raw.get("grid"), f"matrix {spec}: grid")
    if grid:
        keys = list(grid)
        for values in itertools.product(*(grid[k] if isinstance(grid[k], list) else [grid[k]] for k in keys)):
            name = "_".join(f"{k.rsplit('.', 1)[-1]}={_name_part(v)}" for k, v in zip(keys, values))
            chosen = dict(zip(keys, values))
            count = _nproc(chosen.pop("nproc", 1), spec)
            experiments.append(Experiment(name, canonical("train", chosen), None, count))
    if not experiments:
        raise TunebenchError(f"matrix {spec} has no experiments; add an experiments list or a grid")
    unique_names(experiments, spec)
    if nproc:  # --nproc: every experiment at each count
        experiments = with_processes(experiments, nproc)
    for e in experiments:  # every experiment's settings are checked before anything runs, at its process count
        try:
            cfg = load_config(options={**base, **e.overrides}, world_size=e.nproc)
        except TunebenchError as err:
            raise TunebenchError(f"matrix {spec}, experiment '{e.name}': {err}") from err
        if cfg.objective.unit != "rows" and sizing.budget_seconds(raw.get("budget"), spec) is not None:
            raise TunebenchError(f"matrix {spec}, experiment '{e.name}': budget times SFT rows, not {cfg.objective.name} "
                                 "pairs; give base data.max_samples instead of the budget")
    return base, experiments


def unique_names(experiments: list[Experiment], spec: str) -> None:
    seen: set[str] = set()
    for e in experiments:
        if e.name in seen:
            raise TunebenchError(f"matrix {spec}: two experiments are named '{e.name}' (their results and run "
                                 "directories would collide); give each a name of its own")
        seen.add(e.name)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TunebenchError(f"{what} must be a mapping of dotted keys to values (e.g. train.lr: 1e-4), got {value!r}")
    return dict(value)


def _devices(value: Any, spec: str, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or any(d not in DEVICES for d in value):
        raise TunebenchError(f"matrix {spec}, experiment '{name}': devices must be a list drawn from "
                             f"{', '.join(DEVICES)} (e.g. devices: [cuda]), got {value!r}")
    return tuple(value)


def _name_part(value: Any) -> str:
    """A grid value as it reads in an experiment's name, made safe as a directory name."""
    text = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return re.sub(r"[^A-Za-z0-9._+,@-]+", "-", text).strip("-.") or "x"


def _nproc(value: Any, spec: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TunebenchError(f"matrix {spec}: nproc must be a whole number of processes, 1 or more; got {value!r}")
    return value


def with_processes(experiments: list[Experiment], counts: list[int]) -> list[Experiment]:
    """Every experiment at each process count (`--nproc 1,2`); a count above 1 is part of the name."""
    out = [dataclasses.replace(e, name=e.name if n == 1 else f"{e.name}_np{n}", nproc=n)
           for e in experiments for n in counts]
    unique_names(out, "with --nproc")
    return out


def devices_present() -> tuple[list[str], dict[str, str]]:
    import torch

    present, absent = ["cpu"], {}
    if torch.cuda.is_available():
        present.append("cuda")
    else:
        absent["cuda"] = "no CUDA GPU visible"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        present.append("mps")
    else:
        absent["mps"] = "Apple MPS not available"
    return present, absent


def upgrade(path: Path) -> None:
    """A results CSV an earlier release wrote, whose columns are all still in SCHEMA (a release added columns,
    as the tool-call scores were), rewritten in today's layout with those cells empty, so a comparison resumes
    across the upgrade; written beside and renamed, so an interruption leaves the old file whole."""
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        old = reader.fieldnames or []
        if old == SCHEMA or not old or not set(old) < set(SCHEMA):
            return
        rows = list(reader)
    with atomic_file(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SCHEMA, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"{path}: rewritten with this release's {len(SCHEMA) - len(old)} new column(s), empty for its "
          f"{len(rows)} earlier row(s)")


def read_done(path: Path, ok_only: bool = False) -> set[tuple[str, str, int]]:
    """(experiment, device, repeat) of the rows already written; with ok_only, of the successful ones.
    A damaged row (a torn write, a hand edit) is skipped and counted: it reruns rather than crashing."""
    if not path.is_file() or path.stat().st_size == 0:
        return set()
    done, bad = set(), 0
    upgrade(path)
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != SCHEMA:
            raise TunebenchError(f"'{path}' has another column layout than this tunebench writes; "
                                 "pass a new --output file")
        for r in reader:
            try:
                if None in r or any(r.get(k) is None for k in SCHEMA) or r["status"] not in STATUSES:
                    raise ValueError
                key = (r["experiment"], r["device"], int(r["repeat"]))
            except (ValueError, TypeError):
                bad += 1
                continue
            if not ok_only or r["status"] == "ok":
                done.add(key)
    if bad:
        print(f"{path}: skipped {bad} damaged row(s); their experiments run again")
    return done


STATUSES = ("ok", "oom", "error", "pruned")


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append one row and make it durable before the next experiment starts; a torn last row (a kill or
    a full disk mid-write) is cut off first, so the new row never glues onto it."""
    repair_tail(path)
    new = not path.is_file() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_no_follow(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCHEMA)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in SCHEMA})
        f.flush()
        os.fsync(f.fileno())


def _row_from_run(run_dir: Path, device: str) -> dict[str, Any]:
    s = RunDir(run_dir).summary()
    plan = json.loads((run_dir / "plan.json").read_text())
    hw = plan["hardware"]
    decided = {d["setting"]: d["value"] for d in plan["decisions"]}
    device_name = hw["gpus"][0]["name"] if device == "cuda" and hw["gpus"] else \
        f"{hw['cpu_model']} ({decided.get('torch_threads')} threads)"
    v = hw["versions"]
    return {
        "device_name": device_name, "cores": hw["physical_cores"], "processes": s.world_size,
        "threads": decided.get("torch_threads"),
        # batch_size: the study's name for the column (its report script and results CSVs read it)
        "batch_size": s.micro_batch_size, "grad_accum": s.grad_accum_steps,
        "effective_batch": s.effective_batch_size, "method": s.method, "quantization": s.quantization,
        "precision": s.precision, "max_length": s.max_length, "samples": s.samples, "steps": s.steps,
        "duration_seconds": round(s.train_time_s, 3), "measure_seconds": s.measure_s,
        "predicted_seconds": ((s.get("plan_check") or {}).get("train_time_s") or {}).get("predicted"),  # the plan's
        "samples_per_s": s.samples_per_s, "it_per_s": s.it_per_s,
        "tokens_per_s": s.tokens_per_s, "peak_memory_mb": s.peak_memory_mb,
        "final_train_loss": s.final_train_loss, "eval_loss": s.eval_loss, "mfu": s.mfu,
        **{k: s.get(k) for k in quality.TASK_SCORES},
        "objective": s.objective, "reward_accuracy": s.get("eval_rewards/accuracies"),
        **{column: s.get(key) for column, key in EPISODE_COLUMNS.items()},
        "trainable_params": s.trainable_parameters or s.parameters,
        "torch_version": v.get("torch"), "transformers_version": v.get("transformers"),
        "peft_version": v.get("peft"), "bitsandbytes_version": v.get("bitsandbytes"),
    }


def _failure(stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    message = lines[-1] if lines else "no message"
    oom = any(k in stderr.lower() for k in ("out of memory", "outofmemoryerror", "cannot allocate memory"))
    return ("oom" if oom else "error"), message[:500]


def main(matrix: str, output: str, runs_dir: str | None, repeats: int, extra: dict[str, Any],
         devices: list[str] | None, retry_failed: bool, nproc: str | None, report_dir: str | None) -> None:
    """`tunebench compare`: the matrix run (its results beside `output`, runs under runs_dir, default the
    output's folder/runs), then the report (default the output's folder/report)."""
    if repeats < 1:
        raise TunebenchError(f"--repeats must be 1 or more, got {repeats}")
    counts = None
    if nproc:
        try:
            counts = [int(n) for n in nproc.split(",")]
        except ValueError:
            counts = [0]
        if min(counts) < 1:
            raise TunebenchError(f"--nproc {nproc}: give numbers of processes, 1 or more, such as 1,2")
    out = Path(output)
    results = run(matrix, str(out), runs_dir or str(out.parent / "runs"), repeats, extra, devices, retry_failed, counts)
    print(f"report: {report.write([str(results)], report_dir or str(out.parent / 'report')).resolve()}")


def run(matrix: str, output: str, runs_dir: str, repeats: int, extra: dict[str, Any],
        devices: list[str] | None = None, retry_failed: bool = False, nproc: list[int] | None = None) -> Path:
    base, experiments = load_matrix(matrix, extra, nproc)
    base = tracked("train", None, base, Path(output).resolve().parent.name)
    present, absent = devices_present()
    for d in devices or []:
        if d not in present:
            print(f"skipping device {d}: {absent.get(d, 'not present')}")
    usable = [d for d in devices or present if d in present]
    results = Path(output)
    done = read_done(results, ok_only=retry_failed)
    jobs = [(exp, device, repeat) for exp in experiments for device in usable
            if exp.devices is None or device in exp.devices for repeat in range(1, repeats + 1)]
    todo = [j for j in jobs if (j[0].name, j[1], j[2]) not in done]
    print(f"{len(jobs)} experiments on {', '.join(usable)}; "
          f"{len(jobs) - len(todo)} already in {results}, {len(todo)} to run")
    budget = sizing.budget_seconds(read_yaml(matrix_path(matrix)).get("budget"), matrix)
    if budget is not None and todo and "data.max_samples" not in (extra or {}):
        record = results.with_name(results.stem + ".sizing.json")
        if not read_done(results):
            record.unlink(missing_ok=True)  # new results: measure this machine afresh
        sized = sizing.size(base, budget, len(jobs), "cpu" if "cpu" in usable else usable[0], record)
        print(f"data.max_samples {sized.max_samples}: {sized.reason}; --max-samples N overrides")
        base = base | {"data.max_samples": sized.max_samples}
    elapsed: list[float] = []
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        _run_all(todo, base, runs_dir, results, elapsed)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"results: {results}")
    return results


def raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _run_all(todo, base: dict[str, Any], runs_dir: str, results: Path, elapsed: list[float]) -> None:
    for k, (exp, device, repeat) in enumerate(todo, 1):
        eta = f", ETA {_clock(statistics.mean(elapsed) * (len(todo) - k + 1))}" if elapsed else ""
        print(f"[{k}/{len(todo)}] {exp.name} on {device}, repeat {repeat}{eta}", flush=True)
        run_dir = Path(runs_dir) / f"{exp.name}-{device}-r{repeat}"
        t0 = time.perf_counter()
        proc = start("train", {**base, **exp.overrides}, run_dir, device, exp.nproc)
        try:
            proc.wait()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run checkpoints and stops with us
            children.stop(proc)
            raise TunebenchError(f"interrupted: {exp.name} stopped with a checkpoint in {run_dir}; rerun the same "
                                 "command to go on from it, then with the experiments not yet in the results", 130) from None
        elapsed.append(time.perf_counter() - t0)
        row = finish(proc, run_dir, device) | {"experiment": exp.name, "config": exp.name, "repeat": repeat}
        if row["status"] == "ok":
            print(f"    {row['duration_seconds']:.1f} s, {row['tokens_per_s'] or 0:,.0f} tokens/s, "
                  f"micro batch {row['batch_size']} x {row['grad_accum']}")
        else:
            print(f"    {row['status']}: {row['message']}")
        append_row(results, row)


# Each job's keys for what the runner sets on every run.
RUN_KEYS = {"device": "hardware.device", "output_dir": "output.output_dir", "progress": "logging.progress",
            "overwrite": "output.overwrite", "resume": "output.resume"}  # the shared sections': the same keys for train and pretrain


def canonical(job: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with each key in its one spelling, so a later mapping merged over it wins (schema.Schema)."""
    return (finetune_config.SCHEMA if job == "train" else pretrain_config.SCHEMA).canonical(settings)


def tracked(job: str, config: str | None, settings: dict[str, Any], name: str) -> dict[str, Any]:
    """`settings` with a compare's or a study's runs named for the trackers as one: their group `name`, and
    `name` as their MLflow experiment (W&B, Trackio project) unless the config or settings name one."""
    settings = canonical(job, settings)
    cfg = load_job_config(job, config, settings)
    named = {"logging.group": cfg.logging.group or name}
    if cfg.logging.project is None:
        named["logging.project"] = name
    return settings | named


def load_job_config(job: str, config: str | None, settings: dict[str, Any], nproc: int = 1):
    """The whole configuration of one `train` or `pretrain` run: its config file (if any) under `settings`,
    checked at the number of processes it will run in."""
    if job == "train":
        return load_config(config, settings, world_size=nproc)
    return pretrain_config.load(config, settings, world_size=nproc)


def start(job: str, settings: dict[str, Any], run_dir: Path, device: str | None = None, nproc: int = 1,
          config: str | None = None) -> subprocess.Popen:
    """Start one `tunebench train|pretrain` run in its own process (`launch` for several ranks), its
    output in run_dir/log.txt. The child gets its whole configuration as a file (run_dir/asked.yaml),
    runs in a process group of its own that `children.stop` ends, and is sent SIGTERM (it checkpoints and stops)
    if this process dies first. A rerun goes on from the checkpoint an interrupted attempt left in run_dir, and
    replaces what an attempt with other settings left."""
    keys = RUN_KEYS
    settings = {**settings, keys["output_dir"]: str(run_dir), keys["progress"]: False, keys["overwrite"]: True}
    if device is not None:
        settings[keys["device"]] = device
    if any((run_dir / "checkpoints").glob("step-*")):  # an interrupted attempt: go on from its checkpoint
        settings[keys["resume"]] = "auto"  # (one made with other settings is replaced: overwrite is asked too)
    cfg = load_job_config(job, config, settings, nproc)
    (run_dir / "log.txt").unlink(missing_ok=True)  # this attempt's output alone
    return children.start(job, cfg, run_dir, log=run_dir / "log.txt", err=run_dir / "stderr.txt", nproc=nproc)



def finish(proc: subprocess.Popen, run_dir: Path, device: str) -> dict[str, Any]:
    """The results row of a finished run: its figures, or its status (oom, error) and last line."""
    row: dict[str, Any] = {"device": device, "hostname": socket.gethostname(), "run_dir": str(run_dir),
                           "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    stderr = (run_dir / "stderr.txt").read_text(errors="replace")
    with open_no_follow(run_dir / "log.txt", "a") as log:
        log.write(stderr)
    keep_record(run_dir)
    if proc.returncode == 0 and (run_dir / "summary.json").is_file():
        return row | _row_from_run(run_dir, device) | {"status": "ok"}
    status, message = _failure(stderr)
    return row | {"status": status, "message": message}


def keep_record(run_dir: Path) -> None:
    """Beside each run: the study's system_info.txt, and the run's own report (its loss, throughput, CPU
    and memory over time), which compare's report links to. A run that logged nothing gets neither."""
    from tunebench.jobs import hw

    if not run_report.is_run(run_dir):
        return
    with atomic_file(run_dir / "system_info.txt") as tmp:
        machine, _, record = hw.machine()
        tmp.write_text(hw.system_info(machine, record))
    run_report.write(run_dir)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


