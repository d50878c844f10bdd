"""The environment a child process starts with. A server's own secrets (the page's login, the API key) stay in
the server: no child it starts (a training run, an export, llama.cpp's converter, pip) needs them, and a child
may print its environment or hand it on."""

from __future__ import annotations

import os

SECRET_ENV = ("TUNEBENCH_AUTH", "TUNEBENCH_API_KEY")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without SECRET_ENV, with `extra` on top."""
    return {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, **extra}
