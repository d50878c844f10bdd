"""Configuration files as YAML: read (safely: no expanding aliases, one-line errors with the fix), an override's
value as YAML reads it, and a run's configuration written back. schema.py holds what the keys mean; this, how
their files are read and written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError


class _Loader(yaml.SafeLoader):
    """YAML's safe loader without aliases to lists or mappings: five nested ones grow a few lines into
    megabytes (a "billion laughs" file); an alias to a plain value stays allowed."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if isinstance(self.anchors.get(event.anchor), (yaml.MappingNode, yaml.SequenceNode)):
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} repeats a list or mapping, "
                                                  "which tunebench does not expand", event.start_mark)
        return super().compose_node(parent, index)


def load_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise TunebenchError(f"config file '{p}' not found; check the path")
    try:
        loaded = load_yaml_text(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TunebenchError(f"config file '{p}' is not valid YAML ({first}); fix the syntax") from e
    except RecursionError:
        raise TunebenchError(f"config file '{p}' nests lists or mappings too deep to read; a config is sections "
                             "of keys and values") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise TunebenchError(f"config file '{p}' must hold a mapping of sections (model, data, ...)")
    return loaded


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise TunebenchError(f"override '{text}' must look like section.key=value, e.g. optimizer.lr=1e-4")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), load_yaml_text(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise TunebenchError(f"override '{text}' has a value that is not valid YAML; quote it") from e


def write_config(cfg: Any, path: str | Path) -> None:
    """A run's configuration (fine-tuning's RunConfig or pretraining's PretrainRun) as the YAML file a run keeps
    (config.yaml) and a child run loads (asked.yaml): values, not retyped strings, so what it runs is what was asked
    (a test round-trips the awkward ones)."""
    dump_yaml(cfg.to_dict(), path)


def dump_yaml(tree: dict[str, Any], path: str | Path) -> None:

    with atomic_file(path) as tmp:
        tmp.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
