"""The one reader and writer of tunebench's small JSON files (caches, plans, summaries).

Writes are atomic and durable (durable.atomic_file: a temp file flushed to disk, then a rename), so a
killed process or a power loss never leaves half a file; a damaged file reads as empty, so a cache is remeasured rather than trusted
or crashed on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunebench.core.durable import atomic_file


def read_json(path: str | Path) -> dict[str, Any]:
    """The object in `path`, or {} when the file is missing, unreadable or not a JSON object."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: str | Path, data: Any, indent: int = 2) -> None:
    with atomic_file(path) as tmp:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, default=str)
            f.write("\n")


def update_json(path: str | Path, key: str, value: Any) -> None:
    """Set one key of a JSON object file (a cache entry), keeping the others."""
    data = read_json(path)
    data[key] = value
    write_json(path, data, indent=1)


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(records, lines skipped): a torn line (a kill or a full disk mid-write) is skipped and counted,
    never a crash."""
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def records(path: Path) -> list[dict[str, Any]]:
    """read_jsonl's records of a file another process may still be writing; [] before it exists."""
    return read_jsonl(path)[0] if path.is_file() else []
