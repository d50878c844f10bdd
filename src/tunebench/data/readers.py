"""Read a dataset file (CSV, JSON, JSONL, Parquet, a saved HF datasets directory) into records."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError

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
                except RecursionError:
                    raise TunebenchError(f"dataset '{path}' line {i} nests lists or objects too deep to read; a "
                                         "record is a flat object of columns") from None
        return rows
    try:
        data = json.loads(text)
    except RecursionError:
        raise TunebenchError(f"dataset '{path}' nests lists or objects too deep to read; give a list of flat "
                             "records") from None
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


def _csv_records(path: Path, text: str) -> list[Record]:
    """Rows of a CSV file, refused at the first line that does not parse: the csv module's default
    reading swallows everything after an unclosed quote into one field and trains on that."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    start = 1  # the line the current record begins on
    try:
        header = next(reader, [])
        if not header:
            return []
        rows = []
        start = reader.line_num + 1
        for fields in reader:
            if fields and len(fields) != len(header):
                raise TunebenchError(
                    f"dataset '{path}' line {start} has {len(fields)} fields, the header has {len(header)}; "
                    "quote fields that contain commas (\"a, b\") and fix that line")
            if fields:  # a blank line is no record
                rows.append(dict(zip(header, fields)))
            start = reader.line_num + 1
    except csv.Error as e:
        if "unexpected end of data" in str(e):
            raise TunebenchError(f"dataset '{path}' line {start}: a quoted field opens there and never closes; "
                                 "close the quote (write a literal quote as \"\")") from e
        raise TunebenchError(f"dataset '{path}' line {start} is not valid CSV ({e}); fix that line's quoting") from e
    return rows


def read_records(spec: str) -> list[Record]:
    path = resolve_path(spec)
    if path.is_dir():
        return _read_hf_dir(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _csv_records(path, _utf8(path))
    elif suffix in (".json", ".jsonl"):
        rows = _json_records(path, _utf8(path))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TunebenchError(f"dataset '{path}' is not a readable Parquet file ({e}); check the file") from e
    elif suffix in (".sqlite", ".sqlite3", ".db"):
        raise TunebenchError(f"dataset '{path}' is a database: an A/B store of tunebench serve holds preference "
                             "pairs, which train with --method dpo or --method orpo")
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
