"""Training children: one `tunebench train|pretrain` run in a process of its own, started from its whole
configuration written as RUN_DIR/asked.yaml (values, never a retyped argv), in a process group of its own that
`stop` ends. The one runner compare, tune and the studio start their runs through."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tunebench.core.childenv import SAFE_PATH, child_env
from tunebench.core.durable import open_no_follow
from tunebench.core.startup import die_with_parent, libc_prctl
from tunebench.settings import runpaths
from tunebench.settings.schema import RunBase
from tunebench.settings.yamlfiles import write_config


def start(job: str, cfg: RunBase, run_dir: Path, *, log: Path, err: Path | None = None, nproc: int = 1,
          program: list[str] | None = None, env: dict[str, str] | None = None,
          outlive_parent: bool = False) -> subprocess.Popen:
    """`program` (default `tunebench JOB`, through `tunebench launch` for several ranks) on run_dir/asked.yaml,
    written here from `cfg`. Its output is appended to `log` (its errors to `err`, else the same file); it runs
    in a session of its own, so a Ctrl-C to the parent does not reach it; unless `outlive_parent`, it gets
    SIGTERM (it checkpoints and stops) when the process that started it dies, even by kill -9."""
    here = Path.cwd()
    run_dir = Path(os.path.abspath(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    asked = run_dir / "asked.yaml"
    write_config(runpaths.with_absolute_paths(cfg, here), asked)
    launch = ["launch", "--nproc-per-node", str(nproc), "--"] if nproc > 1 else []
    # safe path: `python -m` would put the current folder first on sys.path, so a planted tunebench/ or json.py
    # in the folder the server was started from would run as the server's user; and the child starts in its run
    # folder, which tunebench made, with every path of its configuration made absolute against this one first
    argv = [*(program or [sys.executable, *SAFE_PATH, "-m", "tunebench", *launch, job]), str(asked)]
    parent = os.getpid()
    libc_prctl()  # looked up here, not in the forked child (see libc_prctl)
    env = {**(child_env() if env is None else env), **_tracking_here(cfg, env)}
    with open_no_follow(log, "a") as out, (open_no_follow(err) if err else contextlib.nullcontext()) as errors:
        return subprocess.Popen(argv, stdout=out, stderr=errors or subprocess.STDOUT, text=True, cwd=run_dir,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                preexec_fn=None if outlive_parent else lambda: die_with_parent(parent) and None)


def _tracking_here(cfg: RunBase, env: dict[str, str] | None) -> dict[str, str]:
    """MLflow's store where the child would have found it had it started here: without MLFLOW_TRACKING_URI, MLflow
    keeps its runs in the current folder (3.x: sqlite:///CWD/mlflow.db), and a compare's runs, each started in its
    own run folder, would land in a store each. MLflow's own answer, asked here; nothing where MLflow is not asked
    for, the URI is set, or MLflow is not installed (the child says so)."""
    if "mlflow" not in str(cfg.logging.report_to) or "MLFLOW_TRACKING_URI" in (os.environ if env is None else env):
        return {}
    try:
        import mlflow  # heavy (a second or two): only where a run reports to it
    except ImportError:
        return {}
    return {"MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}


def stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """End a run started by `start`, with its whole process group (launch's ranks too): SIGTERM, which saves a
    checkpoint, then SIGKILL if it has not ended after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
