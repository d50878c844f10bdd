"""What `report_to` may name (HF's spellings of the experiment trackers tunebench feeds) and what each needs
before a run starts: its package installed (found without importing it, so the check costs nothing before
torch loads) and, for W&B, somewhere to write."""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tunebench.core.errors import TunebenchError

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")


def parse(value: Any) -> str:
    """HF's report_to, a list (`report_to: [mlflow, tensorboard]`, `--report-to mlflow wandb`) or one string
    (`mlflow,wandb`, `none`), as the trackers' names joined by commas in the order given, or "none"."""
    items = value if isinstance(value, (list, tuple)) else [value]
    names: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str):
            raise TunebenchError(f"logging.report_to got {value!r:.60}; give tracker names: {', '.join(TRACKERS)} "
                                 "or none")
        names += [n for n in item.replace(",", " ").lower().split() if n not in names]
    unknown = [n for n in names if n not in (*TRACKERS, "none")]
    if unknown:
        hint = ("'all' would depend on what happens to be installed; name the ones you want" if "all" in unknown
                else "not one of " + ", ".join(TRACKERS))
        raise TunebenchError(f"logging.report_to {', '.join(unknown)}: {hint} (or none)")
    if "none" in names and len(names) > 1:
        raise TunebenchError(f"logging.report_to {','.join(names)} lists none beside trackers; give one or the other")
    return ",".join(names) if names else "none"


def names(report: str) -> list[str]:
    """The tracker names of a report_to value (parse's output)."""
    return [] if report == "none" else report.split(",")


# The module each tracker imports (its extra, tunebench[NAME], installs it)
TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}


def check(report: str) -> None:
    """Each tracker asked for is installed (and W&B can write somewhere), refused here with the fix, before
    any model loads: found without importing them (find_spec)."""
    for name in names(report):
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            raise TunebenchError(f"--report-to {name} needs the {name} package: pip install 'tunebench[{name}]'")
    if "wandb" in names(report) and not wandb_can_write():
        raise TunebenchError("--report-to wandb needs a W&B login: run `wandb login` (or set WANDB_API_KEY), or set "
                             "WANDB_MODE=offline to keep the run on disk and `wandb sync` it later")


def wandb_can_write() -> bool:
    """Whether wandb.init would start without asking for a key: offline or disabled mode (the environment, or
    `wandb offline`'s settings file), an API key in the environment, or one `wandb login` stored in ~/.netrc."""
    mode = os.environ.get("WANDB_MODE", "")
    for path in (Path("wandb/settings"), Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config/wandb"))
                 / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        mode = mode or parser.get("default", "mode", fallback="")
    if mode.lower() in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
