"""Image-question-answer records (the MedPix-VQA schema) from local files, read lazily row by row.

Accepted sources, all local:

- a ``.parquet`` file, or a folder of them (a Hugging Face dataset snapshot: ``data/train-*.parquet``);
- a ``datasets`` folder written by ``Dataset.save_to_disk`` (``state.json`` + Arrow stream files), or a
  ``DatasetDict`` folder (``dataset_dict.json``), whose ``train`` split is read;
- a ``.jsonl`` file with one ``{"image": path, "question": ..., "answer": ...}`` object per line; relative
  image paths are relative to the file's folder.

The image column is ``image_id`` (the public MedPix-VQA name) or ``image``: a path, bytes, or the
``{"bytes", "path"}`` record of the ``datasets`` Image feature. Rows are 1-based in messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan_kimi.data.records import read_records

IMAGE_COLUMNS = ("image_id", "image")
TEXT_COLUMNS = ("question", "answer")
DEFAULT_SPLIT = "train"


def _import_pyarrow(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow, which is not installed: `pip install pyarrow` "
                         f"(the [data] extra), or convert the data to JSON lines") from None
    return pa, pq


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder (a ``DatasetDict`` folder: its train split)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if DEFAULT_SPLIT not in splits:
            raise ValueError(f"{folder} is a DatasetDict with splits {splits}; pass the folder of one split "
                             f"(e.g. {folder / (splits[0] if splits else 'train')})")
        folder = folder / DEFAULT_SPLIT
    state = json.loads((folder / "state.json").read_text())
    files = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    if not files:
        raise ValueError(f"{folder}/state.json lists no data files")
    return files


class ImageTextRecords:
    """``len(records)``, ``records.row(i) -> {"image", "question", "answer"}`` and ``records.where(i)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._rows: list[dict[str, Any]] | None = None
        self._table = None
        self._files: list[tuple[str, int]] = []  # (file name, rows) for messages
        path = self.path
        if path.is_dir():
            if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
                self._read_arrow(_saved_dataset_files(path), stream=True)
            else:
                parquet = sorted(path.rglob("*.parquet"))
                if not parquet:
                    raise ValueError(f"{path} is a folder with no *.parquet files and no datasets state.json; "
                                     f"expected parquet files, a save_to_disk folder or a .jsonl file")
                self._read_arrow(parquet, stream=False)
        elif path.suffix.lower() == ".parquet":
            self._read_arrow([path], stream=False)
        elif path.suffix.lower() == ".arrow":
            self._read_arrow([path], stream=True)
        else:
            self._read_jsonl()

    # ------------------------------------------------------------------ readers
    def _read_jsonl(self) -> None:
        base = self.path.parent
        self._rows, self._row_numbers = [], []
        for row, record in read_records(self.path):
            image = self._image_field(record, f"{self.path}: row {row}")
            if isinstance(image, str) and not Path(image).is_absolute():
                image = str(base / image)
            self._rows.append({"image": image, **{k: record.get(k) for k in TEXT_COLUMNS}})
            self._row_numbers.append(row)
        self._files = [(str(self.path), len(self._rows))]

    def _read_arrow(self, files: list[Path], *, stream: bool) -> None:
        pa, pq = _import_pyarrow(files[0])
        tables = []
        for file in files:
            if stream:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(file))).read_all())
            else:
                tables.append(pq.read_table(file))
            self._files.append((str(file), tables[-1].num_rows))
        names = tables[0].column_names
        image = next((c for c in IMAGE_COLUMNS if c in names), None)
        missing = [c for c in TEXT_COLUMNS if c not in names]
        if image is None or missing:
            raise ValueError(f"{files[0]}: columns {names} lack {missing or []}"
                             f"{' and an image column ' + str(list(IMAGE_COLUMNS)) if image is None else ''}; "
                             f"the MedPix-VQA schema is image_id (or image), question, answer")
        self._table = pa.concat_tables(tables).select([image, *TEXT_COLUMNS])
        self._image_column = image

    @staticmethod
    def _image_field(record: dict[str, Any], where: str) -> Any:
        for name in IMAGE_COLUMNS:
            if record.get(name) is not None:
                return record[name]
        raise ValueError(f"{where}: no image (expected an {' or '.join(IMAGE_COLUMNS)} field)")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else self._table.num_rows

    def where(self, index: int) -> str:
        """``"<file>: row <n>"`` for the record at ``index`` (rows 1-based within their file)."""
        if self._rows is not None:
            return f"{self.path}: row {self._row_numbers[index]}"
        for file, rows in self._files:
            if index < rows:
                return f"{file}: row {index + 1}"
            index -= rows
        raise IndexError(index)

    def row(self, index: int) -> dict[str, Any]:
        if self._rows is not None:
            return self._rows[index]
        record = {name: self._table.column(name)[index].as_py() for name in self._table.column_names}
        record["image"] = record.pop(self._image_column)
        return record
