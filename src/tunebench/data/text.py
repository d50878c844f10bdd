"""Stream raw text for pretraining and tokenizer training: plain text files, JSONL/JSON/CSV/Parquet
with a text column, a `Dataset.save_to_disk` directory, a directory of text files, or a dataset
already in the local Hugging Face cache. Nothing is read whole into memory where the format can
be streamed, so corpora larger than RAM work.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tunebench.core.errors import TunebenchError

PIECE_CHARS = 32_768  # plain text is handed on in pieces of about this size, cut at line ends
TEXT_SUFFIXES = (".txt", ".md", ".text", "")


def _plain(path: Path, piece_chars: int = PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    buf: list[str] = []
    size = 0
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                buf.append(line)
                size += len(line)
                if size >= piece_chars:
                    yield "".join(buf), False
                    buf, size = [], 0
    except UnicodeDecodeError as e:
        raise TunebenchError(f"'{path}' is not UTF-8 text ({e.reason}); re-save it as UTF-8") from e
    yield "".join(buf), True  # the file is one document: it ends here


def _column(path: Path, row: dict, column: str, line: int) -> str:
    if column not in row:
        raise TunebenchError(f"'{path}' row {line} has no column '{column}' (it has: {', '.join(map(str, row))}); "
                             "set data.text_column")
    value = row[column]
    return "" if value is None else str(value)


def _opens_a_list(path: Path) -> bool:
    """Whether a .json file is one JSON list (read whole) rather than JSON lines (streamed)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.read(4096).lstrip()[:1] == "["


def _records(path: Path, column: str) -> Iterator[tuple[str, bool]]:
    try:
        yield from _rows(path, column)
    except UnicodeDecodeError as e:
        raise TunebenchError(f"'{path}' is not UTF-8 text ({e.reason}); re-save it as UTF-8") from None
    except csv.Error as e:
        raise TunebenchError(f"'{path}' is not a well-formed CSV ({e}); close the quote that is left open") from None


def _rows(path: Path, column: str) -> Iterator[tuple[str, bool]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or suffix == ".json" and not _opens_a_list(path):
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise TunebenchError(f"'{path}' line {i} is not valid JSON ({e.msg}); fix that line") from e
                    except RecursionError:
                        raise TunebenchError(f"'{path}' line {i} nests too deep to read; a record is a flat "
                                             "object of columns") from None
                    yield _column(path, row, column, i), True
    elif suffix == ".json":
        for i, row in enumerate(json.loads(path.read_text(encoding="utf-8")), 1):
            yield _column(path, row, column, i), True
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            # strict: a quote left open raises instead of reading the rest of the file as one field
            for i, row in enumerate(csv.DictReader(f, strict=True), 2):
                yield _column(path, row, column, i), True
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if column not in pf.schema_arrow.names:
            raise TunebenchError(f"'{path}' has no column '{column}' (it has: {', '.join(pf.schema_arrow.names)}); "
                                 "set data.text_column")
        for batch in pf.iter_batches(columns=[column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield ("" if value is None else str(value)), True


def _dataset(ds, column: str, where: str) -> Iterator[tuple[str, bool]]:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if column not in ds.column_names:
        raise TunebenchError(f"{where} has no column '{column}' (it has: {', '.join(ds.column_names)}); "
                             "set data.text_column")
    for value in ds[column] if len(ds) < 100_000 else (row[column] for row in ds):
        yield ("" if value is None else str(value)), True


def files(spec: str) -> list[Path]:
    """The files a data spec names (for fingerprints); [] for a dataset in the HF cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.exists() else []


def pieces(spec: str, column: str = "text", dataset_config: str | None = None,
           piece_chars: int = PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """(text, ends_a_document) pieces of a corpus, in order; plain text comes in pieces of about `piece_chars`."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or \
                (path / "state.json").exists():
            import datasets

            yield from _dataset(datasets.load_from_disk(str(path)), column, f"dataset '{path}'")
            return
        inner = [p for p in files(spec) if not p.name.startswith(".")]
        if not inner:
            raise TunebenchError(f"directory '{path}' holds no files; point --data at text or JSONL files")
        for p in inner:
            yield from pieces(str(p), column, piece_chars=piece_chars)
        return
    if path.is_file():
        if path.suffix.lower() in TEXT_SUFFIXES:
            yield from _plain(path, piece_chars)
        elif path.suffix.lower() in (".jsonl", ".json", ".csv", ".parquet"):
            yield from _records(path, column)
        else:
            raise TunebenchError(f"'{path}' has suffix '{path.suffix}'; use .txt, .jsonl, .json, .csv or .parquet")
        return
    if spec.startswith((".", "/", "~")) or "." in Path(spec).name and "/" not in spec:
        raise TunebenchError(f"data file '{spec}' not found; check --data")
    yield from _dataset(_cached_dataset(spec, dataset_config), column, f"dataset '{spec}'")


def _cached_dataset(name: str, config: str | None):
    """A dataset that is already in the local Hugging Face cache; tunebench never downloads one."""
    import datasets

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        return datasets.load_dataset(name, config, split="train")
    except Exception as e:  # datasets raises many types for "not there"
        raise TunebenchError(
            f"dataset '{name}' is not a file and not in the local Hugging Face cache (tunebench runs offline); "
            "pass a local file or directory with --data (data.train_file)") from e


def fingerprint(specs: list[str], *extra) -> str:
    """A key that changes when any input file (path, size, mtime) or `extra` changes."""
    stat = []
    for spec in specs:
        found = files(spec)
        stat += [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in found] or [spec]
    return hashlib.sha256(json.dumps([stat, extra], default=str).encode()).hexdigest()[:20]
