"""Read a dataset file (CSV, JSON, JSONL, Parquet, a saved HF datasets directory) into records."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from tunebench.errors import TunebenchError

BUILTIN = {"builtin:customer-support": Path(__file__).parent / "sample" / "customer_support.jsonl"}

Record = dict[str, Any]


def resolve_path(spec: str) -> Path:
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec.startswith("builtin:"):
        raise TunebenchError(f"unknown built-in dataset '{spec}'; built-in: {', '.join(BUILTIN)}")
    path = Path(spec).expanduser()
    if not path.exists():
        raise TunebenchError(f"dataset '{spec}' not found; check --data (CSV, JSON, JSONL, Parquet or a datasets dir)")
    return path


def _utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise TunebenchError(
            f"dataset '{path}' is not UTF-8 text (bad byte at offset {e.start}); re-save it as UTF-8"
        ) from e
    except OSError as e:
        raise TunebenchError(f"cannot read dataset '{path}' ({e.strerror}); check its permissions") from e


def _json_records(path: Path, text: str) -> list[Record]:
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or not stripped.startswith(("[", "{")):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TunebenchError(f"dataset '{path}' line {i} is not valid JSON ({e.msg}); fix that line") from e
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if stripped.startswith("{"):  # JSON lines saved as .json
            return _json_records(path.with_suffix(".jsonl"), text)
        raise TunebenchError(f"dataset '{path}' is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from e
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise TunebenchError(f"dataset '{path}' is a JSON object; expected a list of records (or one list inside)")
        data = lists[0]
    return data


def read_records(spec: str) -> list[Record]:
    path = resolve_path(spec)
    if path.is_dir():
        return _read_hf_dir(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        text = _utf8(path)
        rows = list(csv.DictReader(text.splitlines()))
    elif suffix in (".json", ".jsonl"):
        rows = _json_records(path, _utf8(path))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TunebenchError(f"dataset '{path}' is not a readable Parquet file ({e}); check the file") from e
    else:
        raise TunebenchError(f"dataset '{path}' has suffix '{suffix}'; use .csv, .json, .jsonl or .parquet")
    if not all(isinstance(r, dict) for r in rows):
        raise TunebenchError(f"dataset '{path}' must hold records (objects with named fields)")
    return rows


def _read_hf_dir(path: Path) -> list[Record]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise TunebenchError(
            f"'{path}' is a directory but not a saved datasets dataset; point --data at a file or a "
            "directory written by Dataset.save_to_disk"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()
