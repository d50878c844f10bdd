"""What each experiment tracker costs a run: the same `tunebench train` on the tiny model (built-in data, fp32,
every step logged) with --report-to none, tensorboard, mlflow (a local MLflow server this script starts, SQLite
store), wandb (offline) and trackio (a local store), interleaved over --repeats rounds.

For each tracker it prints the medians of:
- the time the tracker spends per logged step in its own thread (summary.json's tracking_ms_per_step/<name>):
  what an integration that logs inside the training loop (HF Trainer's callbacks call the tracker there)
  would add to every step;
- tokens/s of the run, and its ratio to the same run without a tracker measured in the same round (the peer):
  what tunebench's run actually lost, threads sharing the CPU included.

    .venv/bin/python benchmarks/trackers.py                 # 60 steps, 3 rounds
    .venv/bin/python benchmarks/trackers.py --steps 200 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TRACKERS = ("none", "tensorboard", "mlflow", "wandb", "trackio")


def mlflow_server(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(360):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the MLflow server did not start")


def run(tracker: str, out: Path, steps: int, env: dict[str, str]) -> dict:
    argv = [sys.executable, "-m", "tunebench", "train", "--model", "tiny", "--max-steps", str(steps),
            "--max-length", "128", "--batch-size", "4", "--grad-accum", "1", "--precision", "fp32",
            "--logging-steps", "1", "--no-progress", "--output-dir", str(out), "--report-to", tracker,
            "--eval-fraction", "0.02"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tracker}: exit {done.returncode}\n{done.stderr[-2000:]}")
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning: tracking")]
    if warnings:
        raise SystemExit(f"{tracker}: {warnings[0]}")
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tunebench-trackers-"))
    server, url = mlflow_server(root)
    env = dict(os.environ, MLFLOW_TRACKING_URI=url, WANDB_MODE="offline", WANDB_SILENT="true",
               TRACKIO_DIR=str(root / "trackio"), PYTHONWARNINGS="ignore")
    figures: dict[str, list[tuple[float, float | None, float]]] = {t: [] for t in TRACKERS}
    try:
        for repeat in range(args.repeats):
            for tracker in TRACKERS:
                s = run(tracker, root / f"{tracker}-{repeat}", args.steps, env)
                figures[tracker].append((s["tokens_per_s"], s.get(f"tracking_ms_per_step/{tracker}"),
                                         1000 * s["train_time_s"] / s["steps"]))
                print(f"round {repeat + 1}: {tracker:<11} {s['tokens_per_s']:8,.0f} tokens/s", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; tiny model, {args.steps} steps, "
          f"micro batch 4 x 128 tokens, every step logged; medians of {args.repeats} rounds")
    print(f"{'tracker':<12}{'tokens/s':>10}{'vs none':>9}{'step ms':>9}{'tracker ms/step (own thread)':>30}")
    for tracker in TRACKERS:
        rows = figures[tracker]
        speed = statistics.median(r[0] for r in rows)
        # each round's ratio against the run without a tracker in the same round, then their median
        ratio = statistics.median(r[0] / base[0] for r, base in zip(rows, figures["none"]))
        cost = [r[1] for r in rows if r[1] is not None]
        step_ms = statistics.median(r[2] for r in rows)
        print(f"{tracker:<12}{speed:>10,.0f}{ratio:>9.3f}{step_ms:>9.1f}"
              f"{(f'{statistics.median(cost):.2f}' if cost else '-'):>30}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
