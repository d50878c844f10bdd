"""What the studio shows of a run and does with it: the Train tab's live view (the loss points counted, the run
report's charts redrawn as the run logs) and the Runs tab (the table, a run's report, its export, DPO from the
A/B votes). The queue that starts and stops runs is studio.py's; no Gradio here either (studio_tabs.py is the page).
"""

from __future__ import annotations

import contextlib
import html
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tunebench.core.childenv import SAFE_PATH, child_env
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import records
from tunebench.interfaces.web.studio import Ask, Studio
from tunebench.jobs import run_report
from tunebench.settings.rundir import RunDir
from tunebench.settings.schema import EXPORT_FORMATS


def loss_points(run_dir: Path) -> list[dict[str, Any]]:
    """The run's loss curve as rows {step, value, series}, train and eval, read from metrics.jsonl as it grows:
    how far the live view has come (its charts are the run report's)."""
    out = []
    for row in records(RunDir(run_dir).metrics_file):
        for key, series in (("loss", "train loss"), ("eval_loss", "eval loss")):
            if isinstance(row.get(key), (int, float)):
                out.append({"step": row.get("step"), "value": row[key], "series": series})
    return out


LIVE_CHARTS = ("loss", "tokens_per_s", "memory")
METHOD_CHARTS = ("rewards", "grpo_rewards", "kto")  # a preference, GRPO or KTO run's own chart, where it has one


def live_charts(run_dir: Path) -> list[tuple[str, bytes | None]]:
    """(caption, PNG) of the loss, tokens/s and memory charts and the method's own, as the run's report draws
    them (jobs/run_report.py: one drawing of a run, live or finished), from what it has logged so far."""
    run = RunDir(run_dir)
    drawn = {name: (caption, png) for name, caption, png in
             run_report.charts(records(run.metrics_file), records(run.path / "monitor.jsonl"), run.objective())}
    method = next((n for n in METHOD_CHARTS if n in drawn), None)
    return [drawn.get(n, ("", None)) for n in (*LIVE_CHARTS, method)]


class Charts:
    """The live view's charts, shared by every page: a run's are drawn again only when its logs have grown and
    `every` seconds have passed since the last drawing (each drawing is four PNGs that Gradio keeps in its
    cache; a page ticks every 2 s), and at once when the run is no longer training."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._drawn: dict[str, tuple[tuple, float, list]] = {}  # run -> (its logs' sizes, when, its charts)
        self._lock = threading.Lock()

    def get(self, run_dir: Path, training: bool) -> tuple[tuple, list[tuple[str, bytes | None]]]:
        """(the key of the drawing, its (caption, PNG) charts)."""
        key = tuple(p.stat().st_size if p.is_file() else -1
                    for p in (run_dir / "metrics.jsonl", run_dir / "monitor.jsonl"))
        with self._lock:
            was = self._drawn.get(run_dir.name)
            if was is not None and (was[0] == key or (training and time.monotonic() - was[1] < self.every)):
                return was[0], was[2]
        charts = live_charts(run_dir)
        with self._lock:
            self._drawn[run_dir.name] = (key, time.monotonic(), charts)
        return key, charts


RUN_COLUMNS = ["run", "state", "method", "model", "steps", "eval loss", "ROUGE-L", "tokens/s", "peak MB"]


def run_row(studio: Studio, name: str) -> list[str]:
    run = RunDir(studio.runs_dir / name)
    raw = run.raw_config() if run.config_file.is_file() else {}
    try:
        summary = run.summary()
    except TunebenchError:  # a summary.json tunebench did not write: the row shows what the run logged
        summary = None
    steps = [r["step"] for r in records(run.metrics_file) if "loss" in r]

    def fmt(v, digits=3):
        return "" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    method, model = (raw.get("adapter") or {}).get("method", ""), (raw.get("model") or {}).get("name", "")
    if summary is None:  # not finished: what its config and metrics say so far
        return [name, studio.state(name), method, model, str(steps[-1] if steps else ""), "", "", "", ""]
    return [name, studio.state(name), summary.method, summary.model or model, str(summary.steps),
            fmt(summary.eval_loss), fmt(summary.get("rougeL"), 2), fmt(summary.tokens_per_s, 1),
            fmt(summary.peak_memory_mb, 0)]


def runs_table(studio: Studio) -> list[list[str]]:
    return [run_row(studio, n) for n in studio.names()]


def report_or_error(studio: Studio, name: str) -> str:
    """The Runs tab's report pane: the run's report, or why there is none, escaped (an error's words quote what
    the page sent, and the pane is HTML)."""
    try:
        return report_html(studio, name)
    except TunebenchError as e:
        return f"<p>{html.escape(str(e))}</p>"


def report_html(studio: Studio, name: str) -> str:
    """The run's report (`tunebench report RUN`: its charts, memory, settings and why, summary), written now
    from what the run has logged so far, as the body of its self-contained report.html."""
    run = studio.run_path(name)
    if not RunDir(run).metrics_file.is_file():
        return f"<p>{html.escape(name)} has logged nothing yet ({html.escape(studio.state(name))}).</p>"
    page = run_report.write(run).read_text(encoding="utf-8")
    body = page[page.index("<body>") + len("<body>"):page.rindex("</body>")]
    return f"<p>Report: <code>{html.escape(str(run / 'report' / 'report.html'))}</code></p>" + body


EXPORT_TIMEOUT_S = 2 * 3600  # a page's export; --quant auto of a 135M model took 6 minutes on 2 cores


def export(studio: Studio, name: str, fmt: str, quant: str) -> str:
    """`tunebench export` of a finished run, as a child process (the server stays light); the written path, or
    the export's own one-line error."""
    run = Path(os.path.abspath(studio.run_path(name)))  # the export starts in the run's folder: its path whole
    if fmt not in EXPORT_FORMATS:
        raise TunebenchError(f"format {fmt!r}: pick one of {', '.join(EXPORT_FORMATS)}")
    if studio.state(name) != "finished":
        raise TunebenchError(f"run {name!r} is {studio.state(name)}; export a finished run")
    from tunebench.jobs.export import check_quant, output_path

    quant = check_quant(fmt, quant)
    target = output_path(run, fmt, quant, None)
    if target.exists():  # exports never overwrite: the file already there is this run's, in this format
        raise TunebenchError(f"{name} is already exported as {fmt} {quant}: {target} (delete it to export again)")
    # safe path, in the run's folder: not the modules, nor any file, of the folder the server was started from
    done = run_whole([sys.executable, *SAFE_PATH, "-m", "tunebench", "export", str(run), "--format", fmt, "--quant",
                      quant], EXPORT_TIMEOUT_S, cwd=run)
    if done is None:
        raise TunebenchError(f"the export of {name} ran past {EXPORT_TIMEOUT_S // 60} minutes and was stopped; "
                             f"export it from a terminal: tunebench export {run} --format {fmt} --quant {quant}")
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise TunebenchError(lines[-1] if lines else f"export failed (exit {done.returncode})")
    return str(target)


def run_whole(argv: list[str], timeout_s: float, cwd: Path | None = None) -> subprocess.CompletedProcess | None:
    """`argv` run to its end with its output captured, in a process group of its own; past `timeout_s` the whole
    group is killed (None): subprocess.run's timeout kills the child alone, and an export's converter or
    quantizer, its own children, lived on with no one to wait for them."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env=child_env(), start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def offer_export(registry, written: Path) -> str | None:
    """A GGUF export (the file, or the directory holding it) offered in the Chat and A/B lists, answered by
    llama.cpp; its label, or None for an export with no GGUF (the hf format)."""
    from tunebench.interfaces.web.models import entries

    files = [written] if written.suffix == ".gguf" else sorted(written.glob("*.gguf"))
    return registry.add(entries([], [], ggufs=[str(files[0])])[0]) if files else None


def dpo_from_votes(studio: Studio, name: str, db: Path, client: str = "local") -> str:
    """A DPO run on the A/B store's votes, from this run's base model, queued like any other run."""
    from tunebench.data import pairs

    run = studio.run_path(name)
    if not db.is_file() or not len(pairs.from_store(str(db))):
        raise TunebenchError("no A or B votes yet: vote on the A/B tab first (ties and \"both bad\" give DPO no pair)")
    base = RunDir(run).base_model() if RunDir(run).kind() == "adapter" else str(run)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return studio.start(Ask(data=str(db), name=f"{name}-dpo-{stamp}", model=base, method="dpo"), client)
