"""What the benchmarks share: a step clock for HF Trainer, the process's peak memory, and one worker
per process (so that each side's peak memory and threads are its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def step_clock(on_begin=None):
    """A TrainerCallback that records the time at the end of every optimizer step (`.marks`), cleared when
    training (re)starts, as auto_find_batch_size restarts it after an OOM; `on_begin` is called then too."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.marks.clear()
            if on_begin is not None:
                on_begin()

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    return Clock()


def as_the_command() -> None:
    """A tunebench worker runs as the `tunebench` command does (cli.entry): started again with freed memory
    kept for reuse, the collector paused until its loop (see tunebench.core.startup). The peer's process is left
    as Python has it."""
    from tunebench.core import startup
    startup.keep_freed_memory()
    startup.pause()


def check_imports(script: str) -> None:
    """Import every `from tunebench... import Y` and `import tunebench...` in `script`, wherever it sits (the
    workers import lazily), and fail on the first name that is gone: gpu_session.sh --dry-run calls this through
    each benchmark's --check-args, so a benchmark that tunebench's own moves have broken fails on a machine
    without a GPU. Other packages are left out: which are installed is the machine's business (llama-cpp-python
    is missing on the GPU machine, bitsandbytes' CUDA half on a CPU one)."""
    import ast
    import importlib

    def ours(name: str) -> bool:
        return name == "tunebench" or name.startswith("tunebench.")

    for node in ast.walk(ast.parse(Path(script).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and ours(node.module):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule, or ImportError
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    importlib.import_module(alias.name)


def sync(device) -> None:
    """Wait for the GPU's queued kernels, so that a clock read after a step has the step's time."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def peak_mb() -> float:
    """The process's peak resident set, probes included (tunebench's probes reset the kernel's counter)."""
    from tunebench.machine.metrics import process_peak_mb

    return process_peak_mb()


def spawn(script: str, argv: list[str]) -> dict:
    """Run one worker (`script` with `argv --result FILE`) in its own process; its result, plus the
    process's whole wall time (`total_s`: loading, tokenizing, probing and compiling included)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, script, *argv, "--result", out], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker {argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return dict(json.loads(Path(out).read_text()), total_s=time.perf_counter() - start)
