"""Reads local data files as ``(row_number, record)`` pairs: JSON lines, or parquet through pyarrow.

Row numbers are 1-based and are what error messages quote: the line number in a JSON-lines file
(blank lines are skipped but still counted), the row index + 1 in a parquet file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_LINES_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """All records of a local ``.jsonl``/``.json`` (one JSON object per line) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        suffixes = ", ".join(JSON_LINES_SUFFIXES + PARQUET_SUFFIXES)
        raise ValueError(f"data file not found: {path} (expected a local {suffixes} file)")
    suffix = path.suffix.lower()
    if suffix in JSON_LINES_SUFFIXES:
        return _read_json_lines(path)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path)
    raise ValueError(
        f"data file {path} has suffix {suffix!r}; valid suffixes: {list(JSON_LINES_SUFFIXES + PARQUET_SUFFIXES)}"
    )


def _read_json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    records = []
    with open(path, "rb") as f:  # decoded row by row, so an undecodable byte is reported with its row
        for row, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if row == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: row {row} is not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column {e.start + 1}); "
                    f"re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {row} is not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: row {row} is a JSON {type(record).__name__}, expected an object")
            records.append((row, record))
    return records


def _read_parquet(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"reading {path} needs pyarrow, which is not installed: `pip install pyarrow`, "
            f"or convert the file to JSON lines"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a damaged or non-parquet file
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    return list(enumerate(table.to_pylist(), start=1))
