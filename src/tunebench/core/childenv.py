"""The environment a child process starts with. A server's own secrets (the page's login, the API key) stay in
the server: no child it starts (a training run, an export, llama.cpp's converter, pip) needs them, and a child
may print its environment or hand it on."""

from __future__ import annotations

import os
import sys

SECRET_ENV = ("TUNEBENCH_AUTH", "TUNEBENCH_API_KEY")
# Python's safe-path mode for `python -m` / `-c` children: the current folder is not put first on sys.path, so a
# planted tunebench/ or json.py there never runs. Python 3.10 has no such mode (-P came in 3.11): there it is left out.
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


# variables that name folders: made absolute, since a child may start in another folder (a run starts in its own)
PATH_ENV = ("PYTHONPATH", "TUNEBENCH_CACHE", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE",
            "TRANSFORMERS_CACHE", "TORCHINDUCTOR_CACHE_DIR", "WANDB_DIR", "TRACKIO_DIR")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without SECRET_ENV, the folders of PATH_ENV absolute (PYTHONPATH's entries each; an empty entry,
    Python's current folder, stays the child's own), with `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    for key in PATH_ENV:
        if env.get(key):
            env[key] = os.pathsep.join(os.path.abspath(p) if p else p for p in env[key].split(os.pathsep))
    return {**env, **extra}
