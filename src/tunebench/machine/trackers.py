"""Experiment trackers: TensorBoard, MLflow, Weights & Biases and Trackio, each fed the same records.

What every tracker gets (HF Trainer's callbacks give each backend something different):
- at the start, as parameters: the configuration as asked (`config/<section.key>`), every settings row of
  plan.json with the reason it was chosen (`settings/<name>` and `settings/<name>/reason`), and the machine
  it was measured on (`machine/<key>`);
- at each logged step: the numbers of that metrics.jsonl row under the same names (loss, lr, grad_norm,
  tokens_per_s, eval_loss, rewards/..., ...), with the monitor's latest sample as `system/<name>`;
- at the end: summary.json's numbers as `summary/<name>` (what a runs table sorts by), and files where the
  tracker stores files (MLflow, W&B, Trackio): the run's records, its report, the adapter or model.

Tracking never costs the run. Each tracker runs in its own thread behind a queue, so the training loop only
enqueues; the rows that queued while a tracker was busy go to it in one call (one request to an MLflow server,
which is sent at most once a second), so a slow tracker falls behind by a batch, never by a request a step. The
time each tracker spends per logged step is measured, off the loop, and reported as
`tracking_ms_per_step/<name>`; a tracker that raises (a server down, a full disk) warns once and is dropped,
and the run goes on with metrics.jsonl whole; at the end each queue is drained for as long as it makes progress.

A resumed run continues the same tracker run: the ids are kept in the run directory's trackers.json.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tunebench.core.jsonfile import read_json, write_json

STALL_S = 60.0  # at the end, a tracker that completes nothing for this long is given up on
OPEN_WAIT_S = 30.0  # the loop waits this long at most for the trackers to open (imports, a server's first reply)


USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")  # scheme://user:password@ -> scheme://***@
SECRET_QUERY = re.compile(r"(?i)([?&][\w.-]*(?:token|key|password|passwd|secret|signature|sig|auth)[\w.-]*=)[^&\s#]+")


def redact(text: str) -> str:
    """A tracker's text as it may be printed (a URI, an exception a tracker raised): the user part of every URL
    and the secret-looking query values (token=, api_key=, password=, ...) shown as ***."""
    return SECRET_QUERY.sub(r"\1***", USERINFO.sub(r"\1***@", text))


def mlflow_credentials_apart() -> None:
    """MLFLOW_TRACKING_URI=http://user:password@host as MLflow reads credentials apart from the URI: the user and
    password moved to MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD and the URI left bare, so nothing
    MLflow prints (its "View run ... at: URL" lines, its exceptions) can carry them. Children started later
    inherit the same, equivalent, settings."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return
    if parts.username:
        os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(parts.username)
    if parts.password is not None:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(parts.password)
    os.environ["MLFLOW_TRACKING_URI"] = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


@dataclass(frozen=True)
class Where:
    """What names the run in every tracker."""

    out: Path  # the run directory (trackers.json; W&B's offline files)
    project: str  # MLflow experiment, W&B and Trackio project
    run_name: str
    group: str | None = None
    logging_dir: Path | None = None  # TensorBoard's (default: out/tensorboard)


@dataclass(frozen=True)
class Params:
    """The run's parameters: flat (`settings/lr` -> "0.0002") for MLflow and TensorBoard, nested for the
    trackers that keep a config tree (W&B, Trackio)."""

    flat: dict[str, str]
    nested: dict[str, Any]


def params_of(config: dict[str, Any], plan: dict[str, Any]) -> Params:
    """Parameters from the configuration as asked (config.yaml's tree) and plan.json (the machine, the settings
    rows with their reasons, the job's own figures)."""
    settings: dict[str, dict[str, Any]] = {}
    for row in plan.get("decisions", []):
        name, n = row["setting"], 2
        while name in settings:  # a setting decided twice keeps both rows
            name, n = f"{row['setting']} ({n})", n + 1
        settings[name] = {"value": row["value"], "reason": row["reason"]}
    machine = plan.get("hardware", {})
    extra = {k: v for k, v in plan.items() if k not in ("decisions", "hardware")}
    flat = {f"config/{section}.{k}": _text(v) for section, values in config.items() if isinstance(values, dict)
            for k, v in values.items()}
    for name, row in settings.items():
        flat[f"settings/{name}"] = _text(row["value"])
        flat[f"settings/{name}/reason"] = _text(row["reason"])
    flat.update({f"machine/{k}": _text(v) for k, v in machine.items()})
    flat.update({f"run/{k}": _text(v) for k, v in extra.items()})
    return Params(flat, {"config": config, "settings": settings, "machine": machine, "run": extra})


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def numbers(record: dict[str, Any], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The finite numbers of a record (text, None, booleans and NaN left out)."""
    return {k: float(v) for k, v in record.items() if k not in skip and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Backend(Protocol):
    """One tracker. Its methods run on the tracker's own thread, in the order the run called them."""

    def open(self, where: Where, resume_id: str | None, params: Params) -> str: ...  # the id to resume with
    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None: ...  # (step, values), in step order
    def summary(self, step: int, values: dict[str, float]) -> None: ...
    def files(self, kind: str, paths: list[Path], root: Path) -> None: ...
    def close(self, status: str) -> None: ...  # FINISHED | KILLED (interrupted, resumable) | FAILED


class TensorBoard:
    """Event files in logging_dir, read by TensorBoard (and its EventAccumulator). Its scalars keep the
    train/ and eval/ sections TensorBoard groups charts by; the settings table is a text entry."""

    def open(self, where: Where, resume_id: str | None, params: Params) -> str:
        from torch.utils.tensorboard import SummaryWriter

        path = where.logging_dir or where.out / "tensorboard"
        self.writer = SummaryWriter(str(path))
        rows = [f"| {k[len('settings/'):]} | {v} | {params.flat.get(k + '/reason', '')} |"
                for k, v in params.flat.items() if k.startswith("settings/") and not k.endswith("/reason")]
        self.writer.add_text("settings", "| setting | value | reason |\n|---|---|---|\n" + "\n".join(rows))
        return str(path)

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            for k, v in values.items():
                section = "eval" if k.startswith("eval") else "system" if k.startswith("system/") else "train"
                self.writer.add_scalar(k if section == "system" else f"{section}/{k}", v, step)

    def summary(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"summary/{k}", v, step)

    def files(self, kind: str, paths: list[Path], root: Path) -> None:
        pass  # TensorBoard stores no files

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """A run of the experiment `project` on the tracking server MLFLOW_TRACKING_URI names (mlflow's own
    default without one), through MlflowClient: the fluent API keeps one active run per thread."""

    KEY = re.compile(r"[^\w\-. /]")  # what MLflow allows in a key
    MAX_VALUE = 6000  # MLflow's longest parameter value

    def open(self, where: Where, resume_id: str | None, params: Params) -> str:
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunStatus, RunTag

        mlflow_credentials_apart()
        self.client = client = MlflowClient()
        if resume_id:
            self.run_id = resume_id
            client.update_run(resume_id, status=RunStatus.to_string(RunStatus.RUNNING))
            have = client.get_run(resume_id).data.params  # parameters cannot change: the first run's stay
        else:
            experiment = self._experiment(where.project)
            tags = {"tunebench.output_dir": str(where.out.resolve()), **({"group": where.group} if where.group else {})}
            self.run_id = client.create_run(experiment, run_name=where.run_name, tags=tags).info.run_id
            have = {}
        flat = {self.key(k): v[:self.MAX_VALUE] for k, v in params.flat.items()}
        # A resumed run's decisions that differ (the batch split now comes from the checkpoint, say) are tags
        # resumed/<key>: MLflow refuses to change a parameter, and the first run's values stay.
        changed = [RunTag(f"resumed/{k}"[:250], v) for k, v in flat.items() if k in have and have[k] != v]
        client.log_batch(self.run_id, params=[Param(k, v) for k, v in flat.items() if k not in have],
                         tags=changed)  # the client sends them in batches of MLflow's limits
        print(f"tracking: mlflow run {self.run_id} in experiment '{where.project}' at {redact(client.tracking_uri)}")
        return self.run_id

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another run of the same compare made it a moment ago
            return self.client.get_experiment_by_name(name).experiment_id

    def key(self, name: str) -> str:
        return self.KEY.sub("_", name)[:250]

    FLUSH_S = 1.0  # a request to the server at most this often: the rows queued meanwhile go in one log_batch

    def metrics(self, rows: list[tuple[int, dict[str, float]]], prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.key(prefix + k), v, now, step)
                                                    for step, values in rows for k, v in values.items()])

    def summary(self, step: int, values: dict[str, float]) -> None:
        self.metrics([(step, values)], "summary/")

    def files(self, kind: str, paths: list[Path], root: Path) -> None:
        for path in paths:
            parent = path.relative_to(root).parent.as_posix()
            self.client.log_artifact(self.run_id, str(path), kind if parent == "." else f"{kind}/{parent}")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


class WandB:
    """A W&B run (online with a login, or on disk under WANDB_MODE=offline, in the run directory's wandb/)."""

    NAME = re.compile(r"[^\w\-.]")  # what an artifact's name may hold

    def open(self, where: Where, resume_id: str | None, params: Params) -> str:
        import wandb

        # the user's WANDB_DIR wins where it is set (init's dir= would override it); else the run directory
        self.run = wandb.init(project=where.project, name=where.run_name, group=where.group,
                              dir=os.environ.get("WANDB_DIR") or str(where.out),
                              config=params.nested, id=resume_id, resume="must" if resume_id else None,
                              reinit="create_new")
        self.name = where.run_name
        print(f"tracking: wandb run {self.run.id} in project '{where.project}'"
              + (" (offline: `wandb sync` uploads it)" if self.run.settings.mode == "offline" else f": {self.run.url}"))
        return self.run.id

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def summary(self, step: int, values: dict[str, float]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

    def files(self, kind: str, paths: list[Path], root: Path) -> None:
        import wandb

        artifact = wandb.Artifact(self.NAME.sub("-", f"{self.name}-{kind}"), type=kind)
        for path in paths:
            artifact.add_file(str(path), name=path.relative_to(root).as_posix())
        self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        if status == "KILLED":
            self.run.mark_preempting()  # stopped with a checkpoint: resumable, not crashed
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class Trackio:
    """A Trackio run in its local store (TRACKIO_DIR, else ~/.cache/huggingface/trackio), or on the Space or
    server its environment names. Trackio keeps no summary: the summary's numbers are the last step's."""

    def open(self, where: Where, resume_id: str | None, params: Params) -> str:
        import trackio

        self.run = trackio.init(project=where.project, name=resume_id or where.run_name, group=where.group,
                                config=params.nested, resume="must" if resume_id else "never", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)  # tunebench's monitor samples the machine
        return self.run.name

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def summary(self, step: int, values: dict[str, float]) -> None:
        self.run.log({f"summary/{k}": v for k, v in values.items()}, step=step)

    def files(self, kind: str, paths: list[Path], root: Path) -> None:
        from trackio.artifact import Artifact

        artifact = Artifact(f"{self.run.name}-{kind}", type=kind)
        for path in paths:
            artifact.add_file(str(path), name=path.relative_to(root).as_posix())
        self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        self.run.finish()


BACKENDS: dict[str, Callable[[], Backend]] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB,
                                              "trackio": Trackio}


class Lane:
    """One tracker on its own thread: calls run in order; the first that raises warns once and drops the
    tracker. Rows queued while the tracker was busy (or within its FLUSH_S of the last send) go to it in one
    metrics call. Counts the time its metrics calls take (off the training loop)."""

    def __init__(self, name: str, backend: Backend, opened: Callable[[str, str], None]):
        self.name, self.backend, self.opened = name, backend, opened
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: str | None = None
        self.sent = self.done = 0  # calls queued, and completed (or skipped after a failure)
        self.metrics_s, self.metrics_rows = 0.0, 0
        self.flush_s, self.flushed = float(getattr(type(backend), "FLUSH_S", 0.0)), 0.0  # a class constant
        self.thread = threading.Thread(target=self._work, name=f"tunebench-{name}", daemon=True)
        self.thread.start()

    def put(self, method: str | None, *args: Any) -> None:
        self.sent += 1
        self.calls.put((method, args))

    def _work(self) -> None:
        held = None  # the call met while gathering rows: it runs next
        while True:
            (method, args), held = held or self.calls.get(), None
            taken = 1
            if method == "metrics":
                wait = self.flushed + self.flush_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                rows = [args]
                while held is None:
                    try:
                        call = self.calls.get_nowait()
                    except queue.Empty:
                        break
                    if call[0] == "metrics":
                        rows.append(call[1])
                    else:
                        held = call
                args, taken = (rows,), len(rows)
            if method is not None and self.failed is None:
                started = time.perf_counter()
                try:
                    result = getattr(self.backend, method)(*args)
                    if method == "open":
                        self.opened(self.name, result)
                except Exception as e:  # a tracker never stops the run; the run's own files stay whole
                    first = redact(str(e).splitlines()[0]) if str(e) else ""  # MLflow's name the URI it failed on
                    self.failed = f"{type(e).__name__}: {first}"[:300]
                    print(f"warning: tracking: {self.name} stopped at its {method} call ({self.failed}); the run goes "
                          "on without it, and metrics.jsonl keeps every record")
                if method == "metrics":
                    self.metrics_s += time.perf_counter() - started
                    self.metrics_rows += taken
                    self.flushed = time.monotonic()
            self.done += taken
            if method is None:
                return

    def drain(self, stall_s: float = STALL_S) -> bool:
        """Wait until every queued call ran, giving up when none completes for `stall_s`; True if drained."""
        last, since = self.done, time.monotonic()
        while self.done < self.sent:
            time.sleep(0.02)
            if self.done != last:
                last, since = self.done, time.monotonic()
            elif time.monotonic() - since > stall_s:
                return False
        return True


class Tracking:
    """The run's trackers (none: every call does nothing). `log` takes metrics.jsonl's rows, `system` the
    monitor's samples (the latest rides along with the next logged step); `finish` sends the summary and the
    files; as a context manager, it closes the trackers with the run's outcome."""

    def __init__(self, names: list[str] | tuple[str, ...] = (), where: Where | None = None, resume: bool = False,
                 backends: dict[str, Callable[[], Backend]] | None = None):
        self.where = where
        self.lanes: list[Lane] = []
        self._names, self._resume = list(names), resume
        self._backends = backends or BACKENDS
        self._ids_lock = threading.Lock()
        self._system: dict[str, float] = {}
        self._step = 0
        self.closed = False

    def start(self, params: Params) -> None:
        """Open each tracker (on its thread) with the run's parameters; a resumed run reopens its own."""
        if not self._names or self.where is None:
            return
        saved = read_json(self.where.out / "trackers.json") if self._resume else {}
        for name in self._names:
            lane = Lane(name, self._backends[name](), self._remember)
            lane.put("open", self.where, saved.get(name), params)
            self.lanes.append(lane)
        # Opening imports the tracker (mlflow: ~2 s of CPU) and reaches its server: done before the loop starts,
        # so the loop's first timed steps do not share the CPU with it; a server that does not answer is not
        # waited for beyond OPEN_WAIT_S (the records queue meanwhile).
        deadline = time.monotonic() + OPEN_WAIT_S
        for lane in self.lanes:
            while lane.done == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if lane.done == 0:
                print(f"tracking: {lane.name} is still opening after {OPEN_WAIT_S:.0f} s; training starts, and its "
                      "records wait in its queue")

    def _remember(self, name: str, run_id: str) -> None:
        with self._ids_lock:
            path = self.where.out / "trackers.json"
            write_json(path, read_json(path) | {name: run_id})

    def log(self, record: dict[str, Any]) -> None:
        if not self.lanes:
            return
        values = numbers(record)
        if not values:
            return
        self._step = int(record.get("step", self._step))
        if "loss" in record and self._system:  # a training step's row: the machine's state beside it
            values.update(self._system)
            self._system = {}
        for lane in self.lanes:
            lane.put("metrics", self._step, values)

    def system(self, sample: dict[str, Any]) -> None:
        """A monitor sample (from the monitor's thread): kept until the next training step's row."""
        self._system = {f"system/{k}": v for k, v in numbers(sample, ("time",)).items()}

    @property
    def stores_files(self) -> bool:
        return any(lane.name != "tensorboard" for lane in self.lanes)

    def costs(self) -> dict[str, float]:
        """Each tracker's time per logged step so far, in its own thread (waits for the queued steps first)."""
        out = {}
        for lane in self.lanes:
            lane.drain()
            if lane.metrics_rows and lane.failed is None:
                out[f"tracking_ms_per_step/{lane.name}"] = round(1000 * lane.metrics_s / lane.metrics_rows, 3)
        return out

    def finish(self, summary: dict[str, Any], files: dict[str, list[Path]]) -> None:
        """The summary's numbers at the last step, then each kind of file (run records, report, model), stored
        under the kind's name by their path below the folder they share."""
        for lane in self.lanes:
            lane.put("summary", self._step, numbers(summary))
            for kind, paths in files.items():
                if paths:
                    lane.put("files", kind, paths, Path(os.path.commonpath([p.parent for p in paths])))

    def close(self, status: str = "FINISHED") -> None:
        if self.closed:
            return
        self.closed = True
        for lane in self.lanes:
            lane.put("close", status)
            lane.put(None)
        for lane in self.lanes:
            if not lane.drain():
                print(f"warning: tracking: {lane.name} made no progress for {STALL_S:.0f} s; "
                      f"{lane.sent - lane.done} call(s) not sent")

    def __enter__(self) -> "Tracking":
        return self

    def __exit__(self, kind, error, tb) -> None:
        interrupted = kind is KeyboardInterrupt or getattr(error, "code", None) == 130
        self.close("FINISHED" if kind is None else "KILLED" if interrupted else "FAILED")
