"""The studio: what serve's Train and Runs tabs do, with no Gradio here (tested on its own).

A data file is previewed as training will read it; the settings a run will use are shown with their reasons
before it starts; the run itself is a plain `tunebench train` child process in its own directory under the
runs directory (the same files as from the command line, so closing the page does not stop it and the CLI can
inspect, resume or export it). One run trains at a time on a CPU (two would only split the same cores, and
both their tokens/s would be wrong); a second start waits in a queue the page shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import html
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tunebench.core import runlock
from tunebench.core.batch_rule import micro_candidates
from tunebench.core.childenv import child_env
from tunebench.core.durable import open_no_follow
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_json
from tunebench.data import formats, readers
from tunebench.data.tokenize import segments, tokenize_messages, use_template
from tunebench.interfaces.cli_parser import build_parser, train_config
from tunebench.jobs import children
from tunebench.machine import hardware
from tunebench.machine.hardware import usable_cpus
from tunebench.settings import finetune as finetune_settings
from tunebench.settings import objectives
from tunebench.settings.finetune import BUILTIN_DATA, DEFAULT_MODEL, DataConfig, RunConfig, load_config
from tunebench.settings.rundir import RunDir

SAMPLE = BUILTIN_DATA  # the built-in Bitext-style sample, what `./run compare` trains on
# every method, and the objectives that need no more than a data file of judgements (GRPO needs a reward: the CLI's)
METHODS = (*finetune_settings.METHODS, *(name for name, kind in objectives.BY_NAME.items() if kind().preference))
SHOWN_EXAMPLES = 3
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# What one page may ask of the server: the queue, the page's numbers, the uploads it keeps (see Studio).
MAX_QUEUED, MAX_QUEUED_PER_CLIENT = 8, 2
BOUNDS = {"max_steps": (1, 1_000_000), "epochs": (0.01, 100), "effective_batch": (1, 4096), "max_length": (8, 32_768),
          "processes": (1, 64)}
MAX_UPLOADS, MAX_UPLOAD_BYTES = 16, 2 * 2 ** 30  # files kept for runs, and their total size
STOP_GRACE_S = 120  # after a run's Stop, how long a second Stop sends nothing (the checkpoint being written)
UPLOAD_GRACE_S = 3600  # an upload no run uses yet is kept this long (the page between upload and Start)
PARQUET_MAX_BYTES = 2 * 2 ** 30  # uncompressed, from the file's own metadata, before a row is read
PREVIEW_ROWS = 2000  # the preview reads this many rows, not the whole file
QUANTS = ("f16", "q8_0", "q4_k_m", "q4_0", "auto")  # auto: the smallest within tolerance of f16 on held-out rows


def run_name(name) -> str:
    """The one check for a run name that arrives from a page: a plain name under the runs directory (letters,
    digits, '.', '_', '-'), never a path; every place a run name comes in goes through here."""
    if not isinstance(name, str) or not NAME.match(name):
        raise TunebenchError(f"no run named {str(name)[:80]!r}: a run name is letters, digits, '.', '_' or '-' (up "
                             "to 64), starting with a letter or digit; pick one from the list")
    return name


# -- data ------------------------------------------------------------------------------------------------------

@dataclass
class DataPreview:
    source: str
    fmt: str
    columns: dict[str, str]  # what each part of an example is read from
    rows: int
    kept: int
    dropped: dict[str, int]  # why -> rows
    over_max_length: int  # kept rows longer than max_length: training cuts them
    max_length: int
    examples: list[str]  # HTML: the text the model sees, the part it learns (its loss) marked

    def markdown(self) -> str:
        why = ", ".join(f"{n} {k}" for k, n in self.dropped.items() if n) or "none"
        cols = "; ".join(f"{part} from `{col}`" for part, col in self.columns.items())
        return (f"**{self.source}**: {self.rows} rows, **{self.fmt}** format ({cols}). Kept {self.kept}, dropped "
                f"{self.rows - self.kept} ({why}); {self.over_max_length} of the kept rows are longer than "
                f"max_length {self.max_length} tokens and will be cut. Below, {len(self.examples)} training examples "
                "exactly as the model sees them: the highlighted part is what it learns to write (the loss); the "
                "rest is the prompt.")


def columns_of(fmt: str, cfg: DataConfig) -> dict[str, str]:
    return {"instruction": {"prompt": cfg.instruction_column, "response": cfg.response_column},
            "alpaca": {"prompt": "instruction (+ input)", "response": "output"},
            "question": {"prompt": "question", "response": "answer"},
            "chat": {"turns": cfg.messages_column},
            "text": {"text": cfg.text_column}}[fmt]


def preview(path: str, model: str, max_length: int = 128, template: str = "auto",
            rows: int | None = PREVIEW_ROWS) -> DataPreview:
    """`path`'s first `rows` rows (None: all) read, mapped and rendered as training would (the same readers,
    format detection, prompt format and loss mask); bad data raises the CLI's one-line error. The web server
    reads a sample, never a whole upload."""
    from tunebench.model import models

    cfg = load_config(options={"data.path": path, "data.max_length": max_length, "data.template": template}).data
    records = readers.read_records(path, limit=rows)
    fmt, messages = formats.records_to_messages(records, cfg, path)
    kept = [m for m in messages if not formats.is_empty(m)]
    if not kept:
        raise TunebenchError(f"'{path}' has no usable rows: every row has an empty prompt or response")
    tok = models.tokenizer_for(model)
    whole = dataclasses.replace(cfg, max_length=10 ** 9)
    use_template(kept, tok, cfg)  # tool calls and reasoning: rendered as training renders them
    over = int((tokenize_messages(kept, tok, whole, fmt).lengths() > max_length).sum())
    shown = []
    for m in kept[:SHOWN_EXAMPLES]:
        parts = [f"<mark>{html.escape(text)}</mark>" if loss else html.escape(text)
                 for text, loss in segments(m, tok, cfg)]
        shown.append("".join(parts))
    source = Path(path).name if not path.startswith("builtin:") else path
    if rows is not None and len(records) == rows:
        source += f" (its first {rows:,} rows)"
    return DataPreview(source, fmt, columns_of(fmt, cfg),
                       len(messages), len(kept), {"empty prompt or response": len(messages) - len(kept)}, over,
                       max_length, shown)


def examples_html(p: DataPreview) -> str:
    return "".join(f'<pre class="tb-example" style="white-space:pre-wrap">{e}</pre>' for e in p.examples)


# -- settings --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ask:
    """What the Train tab asks for; everything else is auto."""

    data: str
    name: str
    model: str = DEFAULT_MODEL
    method: str = "lora"
    effective_batch: int | None = None  # None: the default (schema.DEFAULT_EFFECTIVE_BATCH)
    max_steps: int | None = None
    epochs: float | None = None
    max_length: int = 128  # the study's
    processes: int = 1  # ranks on this machine (tunebench launch --nproc-per-node), each rank a share of the batch

    def argv(self, runs_dir: Path) -> list[str]:
        """`tunebench train`'s arguments for this ask."""
        out = ["--data", self.data, "--model", self.model, "--method", self.method, "--max-length",
               str(self.max_length), "--output-dir", str(runs_dir / self.name)]
        if self.effective_batch is not None:
            out += ["--effective-batch-size", str(self.effective_batch)]
        if self.max_steps is not None:
            out += ["--max-steps", str(self.max_steps)]
        if self.epochs is not None:
            out += ["--epochs", str(self.epochs)]
        return out


def check(ask: Ask, runs_dir: Path) -> RunConfig:
    """The run's configuration, through the CLI's own parser and checks (the same one-line errors), before
    anything starts; a name already taken under the runs directory is refused."""
    if not NAME.match(ask.name):
        raise TunebenchError(f"run name {ask.name[:80]!r}: use letters, digits, '.', '_' or '-' (up to 64), starting "
                             "with a letter or digit")
    for key, (low, high) in BOUNDS.items():
        value = getattr(ask, key)
        if value is not None and not low <= value <= high:
            raise TunebenchError(f"{key.replace('_', ' ')} {value:g} is out of this page's range ({low:g} to "
                                 f"{high:g}); run bigger jobs with `tunebench train` from a terminal")

    cores = usable_cpus() or os.cpu_count() or 1
    if ask.processes > cores:  # each rank loads the model and wants a core: more only thrash a shared server
        raise TunebenchError(f"processes {ask.processes}: this server has {cores} core(s) for runs, so at most "
                             f"{cores}; oversubscribe from a terminal (`tunebench launch`) if you mean to")
    if (runs_dir / ask.name).exists():
        raise TunebenchError(f"a run named {ask.name!r} already exists in {runs_dir}; pick another name, or resume "
                             "it from the Runs tab")
    if ask.method not in METHODS:
        raise TunebenchError(f"method {ask.method!r}: pick one of {', '.join(METHODS)}")
    if ask.max_steps is not None and ask.epochs is not None:
        raise TunebenchError("give steps or epochs, not both")
    try:
        args = build_parser().parse_args(["train", *ask.argv(runs_dir), "--no-progress"])
    except SystemExit:  # argparse has printed its usage line to stderr
        raise TunebenchError(f"these settings are not a valid `tunebench train` call: {shlex.join(ask.argv(runs_dir))}"
                             ) from None
    cfg = train_config(args, ask.processes)  # checked at the number of ranks it will run on
    from tunebench.data import pairs
    from tunebench.jobs.parts import finetune_data

    if cfg.data.sources or cfg.objective.preference and pairs.is_store(cfg.data.path):
        finetune_data.check_inputs(cfg)  # a mixture, or the server's own vote store (read within votes.READ_LIMIT_S)
        return cfg
    check_sample(cfg)
    return cfg


CHECK_ROWS = 2000  # rows of an upload the server reads to check it: the training child reads them all


def check_sample(cfg: RunConfig) -> None:
    """The CLI's checks on what a web server may read of an upload (up to 200 MB, several at once): the first
    CHECK_ROWS rows through the same reader, format mapping and empty-row rule (a preference run's: its pairs' or
    judgements' reader), the row count from a stream (no
    rows kept), the model and its length. The training child reads the whole file and refuses a bad row past the
    sample in its log, with the same one-line error."""
    from tunebench.jobs.parts import finetune_data
    from tunebench.model import inference, models

    d = cfg.data
    records = readers.read_records(d.path, limit=CHECK_ROWS)
    if cfg.objective.preference:  # pairs or judgements: the same sample through their own readers
        read = finetune_data.JUDGEMENTS[cfg.objective.data].from_records(records, d, d.path)
        if not len(read):
            raise TunebenchError(f"'{d.path}' holds no usable {cfg.objective.unit} in its first {len(records):,} rows "
                                 f"({read.describe()})")
        usable = len(read) / len(records)
    else:
        _, messages = formats.records_to_messages(records, d, d.path)
        empty = sum(formats.is_empty(m) for m in messages)
        if empty == len(messages):
            raise TunebenchError(f"'{d.path}' has no usable rows: every row of its first {len(messages):,} has an "
                                 "empty prompt or response")
        usable = 1 - empty / len(messages)
    total = len(records) if len(records) < CHECK_ROWS else readers.count_records(d.path)
    if total is not None:  # the usable share of the sample stands for the file's
        finetune_data.check_rows(round(usable * total), cfg, 0, "")
    models.check_spec(cfg.model.name, cfg.model.allow_download)
    if d.max_length is not None:
        inference.check_length(cfg.model.name, d.max_length, cfg.model.allow_download)


def settings_rows(ask: Ask, cfg: RunConfig) -> list[list[str]]:
    """[setting, value, reason]: what was asked on the page, then what tunebench picks on this machine (`tunebench
    hw`'s rows), the measured ones marked as measured when the run starts, as the run's plan will record them."""
    effective = cfg.batch_ask().check(ask.processes)
    rows = [["model", ask.model, "asked on this page"], ["method", ask.method, "asked on this page"],
            ["processes", str(ask.processes), "asked on this page" + (
                "; tunebench launch starts the ranks, each a share of every step's rows" if ask.processes > 1 else "")],
            ["data", ask.data, "asked on this page"], ["max_length", str(ask.max_length), "asked on this page"],
            ["effective_batch_size", str(effective),
             "asked on this page" if ask.effective_batch else "the default; = micro x accumulation x ranks"],
            ["length", f"{ask.max_steps} steps" if ask.max_steps else f"{cfg.schedule.epochs:g} epochs",
             "asked on this page" if ask.max_steps or ask.epochs else "the default"]]
    plan = hardware.plan(cfg.hardware.device, cfg.hardware.precision, hardware.detect(), cfg.hardware.compile)
    rows += [[d.setting, str(d.value), d.reason] for d in plan.decisions]
    sizes = micro_candidates(effective, ask.processes, effective)
    share = effective // ask.processes
    rows += [["micro_batch_size", "measured at start", f"the fastest that fits of {', '.join(map(str, sizes))} "
                                                      f"(the divisors of {share}), timed on this run's model"],
             ["attention", "measured at start", "the fastest kernel on this run's rows"],
             ["learning_rate", f"{cfg.optimizer.lr:g}", "the default (--lr on the command line)"]]
    return rows


# -- runs ------------------------------------------------------------------------------------------------------

@dataclass
class Job:
    name: str
    cfg: RunConfig  # the run's whole configuration, checked: the child starts from it written as RUN/asked.yaml
    log: Path
    owner: str = "local"  # who queued it (interfaces/web/models.client_of): the per-client queue bound counts it
    processes: int = 1  # its ranks (tunebench launch)
    process: subprocess.Popen | None = None
    stopping: bool = False
    stop_sent: float = 0.0  # time.time() of its Stop's SIGTERM


class Studio:
    """The runs directory's training queue: one `tunebench train` child at a time, the others waiting in
    order; a watcher thread starts the next when one ends, whether or not a page is open.

    Shared by whoever has the page's login (one login: every visitor with it may stop or resume any run; serve
    has no accounts to tell them apart), the queue is bounded in all and per client, a Stop is sent once
    however often it is clicked, and the models a run may start from are the `offered` ones (presets, served
    bases, the operator's directories) and this directory's full-model runs."""

    def __init__(self, runs_dir: str | Path, offered: list[str] | None = None):
        from tunebench.model import models

        self.runs_dir = Path(runs_dir).resolve()  # absolute: children and config.yaml name it wherever they run
        self.logs = self.runs_dir / ".studio"
        self.uploads = self.logs / "data"
        self.offered = list(dict.fromkeys([*(offered or []), *models.PRESETS]))
        self.queue: list[Job] = []
        self.current: Job | None = None
        self.finished: dict[str, int] = {}  # name -> exit code, of the runs this studio started
        self.program: list[str] | None = None  # what runs a job's arguments: None, tunebench train (or launch)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="tunebench-studio")
        self._watcher.start()

    # -- who may do what
    def models(self) -> list[str]:
        """What the Train tab's Model field offers: the offered models, then this directory's finished runs that
        hold a whole model (a full fine-tune, a merge), by path."""
        found = sorted(self.runs_dir.iterdir()) if self.runs_dir.is_dir() else []
        runs = [str(d) for d in found if NAME.match(d.name) and (d / "config.json").is_file()
                and RunDir(d).summary_file.is_file()]
        return [*self.offered, *runs]

    def check_model(self, model: str) -> str:
        # the same words whether or not such a path exists on the server: the field is no way to probe its files
        if model not in self.models():
            raise TunebenchError(f"model {model[:80]!r} is not offered here; pick one from the list (the operator "
                                 "offers more directories with `tunebench serve --studio-model DIR`)")
        return model

    # -- the queue
    def start(self, ask: Ask, client: str = "local") -> str:
        if self.state(ask.name) in ("queued", "running", "stopping"):  # not on disk yet when only queued
            raise TunebenchError(f"a run named {ask.name!r} is already {self.state(ask.name)}; pick another name")
        self.check_model(ask.model)
        return self._enqueue(Job(ask.name, check(ask, self.runs_dir), self.logs / f"{ask.name}.log", client,
                                 ask.processes))

    def resume(self, name: str, client: str = "local") -> str:
        run = self.run_path(name)
        if self.state(name).startswith(("running", "queued", "stopping")):
            raise TunebenchError(f"run {name!r} is {self.state(name)}; resume it once it has stopped")
        if RunDir(run).summary_file.is_file():
            raise TunebenchError(f"run {name!r} has finished; start a new run to train more")
        queued = read_json(self.logs / f"{name}.json")
        # the run's own resolved config.yaml, as `tunebench train RUN/config.yaml --resume auto` from a terminal,
        # written where the run is (its config's output_dir may name where it was before a rename)

        processes = queued.get("processes", 1)  # on as many ranks as it started on
        cfg = load_config(RunDir(run).config_file, options={"output.resume": "auto", "output.output_dir": str(run),
                                                             "logging.progress": False}, world_size=processes)
        return self._enqueue(Job(name, cfg, self.logs / f"{name}.log", queued.get("owner") or client, processes))

    def stop(self, name: str, client: str = "local") -> str:
        """SIGTERM to a running run (it saves a checkpoint, which Resume continues from), once: a second click
        says so and sends nothing (a second signal must not cost the checkpoint being written), until STOP_GRACE_S
        have passed since the first; a click after that kills the run's process group (SIGKILL: a run stuck where
        its handler cannot run, a rank waiting in a collective), and Resume continues from its last checkpoint. A
        queued run leaves the queue."""
        run_name(name)
        said = f"{name}: stopping (SIGTERM); it saves a checkpoint first, and Resume continues from it"
        with self._lock:
            for job in self.queue:
                if job.name == name:
                    self.queue.remove(job)
                    return f"{name} taken out of the queue"
            job = self.current
            if job is not None and job.name == name and job.process is not None:
                if not job.stopping:
                    job.stopping, job.stop_sent = True, time.time()
                    job.process.send_signal(signal.SIGTERM)
                    return said
                return self._again(name, job.process.pid, job.stop_sent)
            held = self._pidfile(name)
            if not held or not runlock.alive(held.get("pid", 0), held.get("start")):
                raise TunebenchError(f"run {name!r} is not running" + (
                    " here: it trains in another process; stop it from there" if self._elsewhere(name) else ""))
            if held.get("stopping"):
                return self._again(name, held["pid"], held.get("stop_sent", 0.0))
            os.kill(held["pid"], signal.SIGTERM)
            self._write_pidfile(name, {**held, "stopping": True, "stop_sent": time.time()})
        return said

    def _again(self, name: str, pid: int, sent: float) -> str:
        """A Stop clicked on a run already stopping: nothing sent within STOP_GRACE_S of the first, then SIGKILL to
        its process group (the child leads one of its own: children.start)."""
        waited = time.time() - sent
        if waited < STOP_GRACE_S:
            return (f"{name} is already stopping; it saves its checkpoint, then ends (Stop again after "
                    f"{STOP_GRACE_S - waited:.0f} s more kills it)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return (f"{name} did not end within {waited:.0f} s of its Stop: killed (SIGKILL); Resume continues from its "
                "last checkpoint")

    def _enqueue(self, job: Job) -> str:
        with self._lock:
            waiting = [j for j in self.queue if j.owner == job.owner]
            if len(self.queue) >= MAX_QUEUED:
                raise TunebenchError(f"the queue is full ({MAX_QUEUED} runs waiting); start this once one has begun")
            if len(waiting) >= MAX_QUEUED_PER_CLIENT:
                raise TunebenchError(f"you have {len(waiting)} runs waiting already ({MAX_QUEUED_PER_CLIENT} at most);"
                                     " start this once one of them has begun")
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            self.logs.mkdir(exist_ok=True)
            self.finished.pop(job.name, None)
            with open_no_follow(self.logs / f"{job.name}.json") as f:
                f.write(json.dumps({"owner": job.owner, "processes": job.processes}))
            self.queue.append(job)
            ahead = len(self.queue) - 1 + (self.current is not None) + len(self.left_running())
        self._wake.set()
        return f"{job.name}: " + ("starting" if not ahead else f"queued, {ahead} run{'s' * (ahead > 1)} ahead")

    def _watch(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - the queue outlives any one start; said in the console
                print(f"studio: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _step(self) -> None:
        with self._lock:
            job = self.current
            if job is not None and job.process is not None and job.process.poll() is not None:
                self.finished[job.name] = job.process.returncode
                (self.logs / f"{job.name}.pid").unlink(missing_ok=True)
                self.current = job = None
            if job is None and self.queue and not self.left_running():
                job = self.current = self.queue.pop(0)
                run = self.runs_dir / job.name
                try:  # compare's runner: a session of its own (a Ctrl-C to the server does not reach the run),
                    # and it outlives a restarted server, which finds it by its pid file
                    with open_no_follow(job.log, "a") as log:
                        log.write(f"\n$ tunebench train {run / 'asked.yaml'}\n")
                    job.process = children.start(
                        "train", job.cfg, run, log=job.log, nproc=job.processes, program=self.program, outlive_parent=True,
                        env=child_env(PYTHONUNBUFFERED="1"))
                except Exception as e:  # noqa: BLE001 - whatever stops a start, the run is recorded as failed
                    # with its reason (in its log when that can be written, else the console) and the queue goes
                    # on: a start that raised must not leave `current` set with no process, holding the queue
                    said = f"could not start the run: {type(e).__name__}: {e}"
                    try:
                        with open_no_follow(job.log, "a") as log:
                            log.write(said + "\n")
                    except OSError:
                        print(f"studio: {job.name}: {said}", file=sys.stderr, flush=True)
                    self.finished[job.name] = 127
                    self.current = None
                    self._wake.set()
                    return
                self._write_pidfile(job.name, {"pid": job.process.pid, "start": runlock.process_start(
                    job.process.pid), "owner": job.owner})

    def _pidfile(self, name: str) -> dict:
        return read_json(self.logs / f"{name}.pid")

    def _write_pidfile(self, name: str, held: dict) -> None:
        with open_no_follow(self.logs / f"{name}.pid") as f:
            f.write(json.dumps(held))

    def _elsewhere(self, name: str) -> bool:
        """The run's directory is locked by a training process this studio did not start (a terminal's)."""
        return runlock.holder(self.runs_dir / name) is not None

    def left_running(self) -> dict[str, int]:
        """{run: pid} of the runs an earlier server started that still train (a restarted server sees them, and
        starts nothing beside them). A pid counts only with the start time it was written with: pids are reused."""
        found = {}
        for pidfile in self.logs.glob("*.pid") if self.logs.is_dir() else []:
            if self.current is not None and pidfile.stem == self.current.name:
                continue
            held = read_json(pidfile)
            if runlock.alive(held.get("pid", 0), held.get("start")):
                found[pidfile.stem] = held["pid"]
            else:
                pidfile.unlink(missing_ok=True)
        return found

    def wait(self, name: str, timeout: float) -> int | None:
        """The run's exit code once it has ended (None if it is still going after `timeout` seconds)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if name in self.finished:
                return self.finished[name]
            time.sleep(0.2)
        return None

    # -- what the page shows
    def state(self, name: str) -> str:
        run_name(name)
        with self._lock:
            if self.current is not None and self.current.name == name:
                return "stopping" if self.current.stopping else "running"
            if any(j.name == name for j in self.queue):
                return "queued"
            if name in self.left_running():
                return "stopping" if self._pidfile(name).get("stopping") else "running (started by an earlier server)"
            code = self.finished.get(name)
        run = RunDir(self.runs_dir / name)
        if self._elsewhere(name):
            return "running (another process)"
        if run.summary_file.is_file():
            return "finished"
        if run.checkpoints.is_dir() and any(run.checkpoints.iterdir()):
            return "stopped (checkpoint kept)"
        return "stopped before training" if code == 130 else "failed" if code else "incomplete"

    def queue_text(self) -> str:
        with self._lock:
            running = self.current.name if self.current else None
            waiting = [j.name for j in self.queue]
        if running is None:
            running = next(iter(self.left_running()), None)
        if running is None and not waiting:
            return "Nothing training."
        return (f"Training: **{running}**" if running else "Starting...") + (
            f"; waiting: {', '.join(waiting)}" if waiting else "")

    def names(self) -> list[str]:
        """Every run under the runs directory (those the CLI started too), newest first."""
        if not self.runs_dir.is_dir():
            return []
        found = [d for d in self.runs_dir.iterdir() if d.is_dir() and NAME.match(d.name)
                 and (RunDir(d).config_file.is_file() or (self.logs / f"{d.name}.log").is_file())]
        with self._lock:
            pending = [j.name for j in self.queue] + ([self.current.name] if self.current else [])
        names = [d.name for d in sorted(found, key=lambda d: d.stat().st_mtime, reverse=True)]
        return [n for n in pending if n not in names] + names

    def log_tail(self, name: str, lines: int = 30) -> str:
        log = self.logs / f"{run_name(name)}.log"
        if not log.is_file():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def run_path(self, name: str) -> Path:
        """The directory of the run a page names: a plain name of a run under the runs directory, else refused."""
        if not NAME.match(name if isinstance(name, str) else "") or not (self.runs_dir / name).is_dir():
            raise TunebenchError(f"no run named {str(name)[:80]!r} in {self.runs_dir}; pick one from the list")
        return self.runs_dir / name

    # -- uploads
    def keep_upload(self, file: str) -> str:
        """An uploaded data file kept under the runs directory (Gradio's temporary copy is deleted here): by its
        content, once; a Parquet file whose rows would unpack past PARQUET_MAX_BYTES refused from its metadata;
        uploads no run uses are dropped after UPLOAD_GRACE_S, and the rest are bounded in count and bytes."""
        from tunebench.data import pairs

        src = Path(file)
        try:
            if pairs.is_store(str(src)):  # by its name or its first bytes: never opened as a database here
                raise TunebenchError(f"{src.name} is a SQLite file; upload data as CSV, JSON, JSONL or Parquet (the "
                                     "A/B votes are trained from the server's own store: Runs, then DPO on the votes)")
            if src.suffix.lower() == ".parquet":
                readers.check_parquet(src, PARQUET_MAX_BYTES)
            digest = hashlib.sha256()
            with open(src, "rb") as f:
                for block in iter(lambda: f.read(2 ** 20), b""):
                    digest.update(block)
            safe = re.sub(r"[^A-Za-z0-9._-]", "_", src.name)[-64:]
            with self._lock:
                dest = next(self.uploads.glob(f"{digest.hexdigest()[:16]}-*"), None) if self.uploads.is_dir() else None
                if dest is None:
                    dest = self.uploads / f"{digest.hexdigest()[:16]}-{safe}"
                    kept = self._prune_uploads()
                    held = sum(f.stat().st_size for f in kept)
                    if len(kept) >= MAX_UPLOADS or held + src.stat().st_size > MAX_UPLOAD_BYTES:
                        raise TunebenchError(f"the studio already keeps {len(kept)} uploads ({held / 2 ** 20:,.0f} MB) "
                                             "for runs; delete finished runs, or train this file from a terminal")
                    self.uploads.mkdir(mode=0o700, parents=True, exist_ok=True)
                    # the visitor's data: readable by the server's user only, whatever the umask; never through a
                    # link planted at the name
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with open(fd, "wb") as out, open(src, "rb") as f:
                        shutil.copyfileobj(f, out)
                os.utime(dest)
        finally:
            src.unlink(missing_ok=True)
        return str(dest)

    def _prune_uploads(self) -> list[Path]:
        """Delete the uploads no run (queued, running, or on disk) uses that are older than the grace time; the
        uploads kept."""
        if not self.uploads.is_dir():
            return []
        # the caller holds self._lock
        used = {str(job.cfg.data.path) for job in [*self.queue, *([self.current] if self.current else [])]}
        for d in self.runs_dir.iterdir():
            if d.is_dir() and RunDir(d).config_file.is_file():
                used.add(str((RunDir(d).raw_config().get("data") or {}).get("path")))
        kept = []
        for f in self.uploads.iterdir():
            # a mixture's path names several files (FILE:WEIGHT,...): an upload is used when any run's path holds it
            if not any(str(f) in u for u in used) and time.time() - f.stat().st_mtime > UPLOAD_GRACE_S:
                f.unlink(missing_ok=True)
            else:
                kept.append(f)
        return kept
