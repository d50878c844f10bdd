"""Read a dataset file (CSV, JSON, JSONL, Parquet, a saved HF datasets directory) into records."""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.settings.finetune import BUILTIN_DATA

BUILTIN = {BUILTIN_DATA: Path(__file__).parent / "sample" / "customer_support.jsonl"}

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


def _utf8(path: Path, lines: int | None = None) -> str:
    """The file's text; with `lines`, its first `lines` lines only (JSON lines: a record a line)."""
    try:
        if lines is None:
            return path.read_text(encoding="utf-8-sig")
        with open(path, encoding="utf-8-sig", newline="") as f:
            return "".join(itertools.islice(f, lines))
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


def _csv_records(path: Path, text, limit: int | None = None) -> list[Record]:
    """Rows of a CSV file (its text, or the open file; the first `limit` rows), refused at the first line that
    does not parse: the csv module's default reading swallows everything after an unclosed quote into one field
    and trains on that."""
    reader = csv.reader(io.StringIO(text, newline="") if isinstance(text, str) else text, strict=True)
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
                if limit is not None and len(rows) >= limit:
                    break
            start = reader.line_num + 1
    except csv.Error as e:
        if "unexpected end of data" in str(e):
            raise TunebenchError(f"dataset '{path}' line {start}: a quoted field opens there and never closes; "
                                 "close the quote (write a literal quote as \"\")") from e
        raise TunebenchError(f"dataset '{path}' line {start} is not valid CSV ({e}); fix that line's quoting") from e
    return rows


def read_records(spec: str, limit: int | None = None) -> list[Record]:
    """The file's records; with `limit`, its first `limit` only, read without loading the rest (a preview of a
    large upload; a JSON array is the exception: it parses whole)."""
    path = resolve_path(spec)
    if path.is_dir():
        return _read_hf_dir(path)[:limit]
    suffix = path.suffix.lower()
    if suffix == ".csv" and limit is not None:  # read as a stream: a quoted field may hold line breaks
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:
                rows = _csv_records(path, f, limit)
        except UnicodeDecodeError as e:
            raise TunebenchError(f"dataset '{path}' is not UTF-8 text ({e.reason}); re-save it as UTF-8") from e
    elif suffix == ".csv":
        rows = _csv_records(path, _utf8(path))
    elif suffix in (".json", ".jsonl"):
        rows = _json_records(path, _utf8(path, limit if suffix == ".jsonl" else None))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            if limit is None:
                rows = pq.read_table(path).to_pylist()
            else:
                first = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
                rows = first.to_pylist() if first is not None else []
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TunebenchError(f"dataset '{path}' is not a readable Parquet file ({e}); check the file") from e
    elif suffix in (".sqlite", ".sqlite3", ".db"):
        raise TunebenchError(f"dataset '{path}' is a database: an A/B store of tunebench serve holds preference "
                             "pairs, which train with --method dpo or --method orpo")
    else:
        raise TunebenchError(f"dataset '{path}' has suffix '{suffix}'; use .csv, .json, .jsonl or .parquet")
    if not all(isinstance(r, dict) for r in rows):
        raise TunebenchError(f"dataset '{path}' must hold records (objects with named fields)")
    return rows[:limit]


def count_records(spec: str) -> int | None:
    """How many records the file holds, read as a stream in constant memory (a web server counting an upload it
    does not load): CSV records (quoted line breaks counted right), JSON lines, Parquet rows from its metadata, a
    datasets directory's rows. None for a JSON array, which only a whole parse can count."""
    path = resolve_path(spec)
    suffix = path.suffix.lower()
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))  # memory-mapped: the count is metadata
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds.num_rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".csv":
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:
                reader = csv.reader(f, strict=True)
                next(reader, None)  # the header
                return sum(1 for fields in reader if fields)
        except (csv.Error, UnicodeDecodeError):
            return None  # the sample's reading names the bad line; the training child reads it all
    return None


def check_parquet(path: Path, max_bytes: int) -> None:
    """Refuse a Parquet file whose rows would unpack to more than `max_bytes`, from its metadata alone (a few
    compressed megabytes can hold gigabytes of repeated text)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises several types for a bad file
        raise TunebenchError(f"'{path.name}' is not a readable Parquet file ({e}); check the file") from e
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if size > max_bytes:
        raise TunebenchError(f"'{path.name}' unpacks to {size / 2 ** 20:,.0f} MB, over the {max_bytes / 2 ** 20:,.0f} MB "
                             "this server reads; train it from a terminal, or upload a smaller part")


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
