"""Where tunebench keeps what it makes once and reuses (converted models, tokenized data, measurements,
compile caches): $TUNEBENCH_CACHE, else $XDG_CACHE_HOME/tunebench, else ~/.cache/tunebench. At the bottom of
the package: the measured decisions (tune/) and the models both read it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TUNEBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tunebench"
    )
    return Path(root)
