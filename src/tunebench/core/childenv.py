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


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without SECRET_ENV, with `extra` on top."""
    return {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, **extra}
