"""The safetensors files of an HF checkpoint folder: which key lives in which shard, tensor headers, and reads.

Only ``safetensors.safe_open`` touches the files (no pickle). Headers are read without tensor data; data is
read one slice at a time, and every key whose data is read is recorded in ``keys_read``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # the whole checkpoint when there is no index (the HF convention)
CONFIG_FILE = "config.json"
# safetensors dtype strings a floating model tensor can be converted from.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# An MXFP4 scale is a byte of exponent; some writers label it F8_E8M0.
SCALE_DTYPES = {"U8", "F8_E8M0"}


class ShardFileError(ValueError):
    """A shard file that cannot serve any of its keys (missing, truncated, damaged): reported once per file."""

    def __init__(self, message: str, key: str, file: str) -> None:
        super().__init__(message)
        self.key, self.file = key, file


class MissingShardFile(ShardFileError):
    pass


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # safetensors dtype string, e.g. "BF16", "U8"
    shape: tuple[int, ...]


class HFCheckpoint:
    """An HF safetensors folder: ``model.safetensors.index.json``'s ``weight_map``, or ``model.safetensors`` alone."""

    def __init__(self, path: str | Path, *, max_open_files: int = 2) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(
                f"HF checkpoint {str(self.path)!r} is not a folder (expected *.safetensors shards and {INDEX_FILE})"
            )
        self._headers: dict[str, dict[str, TensorHeader]] = {}
        self._weight_map = self._read_weight_map()
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._max_open = max(1, max_open_files)
        self.keys_read: list[str] = []
        self.files_opened: list[str] = []

    # ------------------------------------------------------------------ index
    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index with a 'weight_map' object ({err})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
            for key, name in weight_map.items():
                if Path(name).name != name or name in ("", ".", ".."):  # shards live in this folder only
                    raise ValueError(
                        f"{index}: key {key!r} maps to {name!r}; a shard must be a file name in the folder"
                    )
            return dict(weight_map)
        # Without an index the checkpoint is the one file HF names model.safetensors; other *.safetensors in
        # the folder (a copy, an adapter, a second export) are not part of it.
        if not (self.path / SINGLE_FILE).is_file():
            others = sorted(p.name for p in self.path.glob("*.safetensors"))
            found = (f"; it holds {others[:5]}{' ...' if len(others) > 5 else ''}, which need an index listing the "
                     f"keys of each file (or rename a single-file checkpoint to {SINGLE_FILE})") if others else ""
            raise ValueError(f"HF checkpoint {str(self.path)!r} has neither {INDEX_FILE} nor {SINGLE_FILE}{found}")
        return {key: SINGLE_FILE for key in self._file_headers(SINGLE_FILE)}

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self._weight_map

    def file_of(self, key: str) -> str:
        return self._weight_map[key]

    def config(self) -> dict[str, Any] | None:
        """The folder's config.json, if it has one."""
        path = self.path / CONFIG_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err})") from None

    # ------------------------------------------------------------------ headers
    def _file_headers(self, name: str) -> dict[str, TensorHeader]:
        if name not in self._headers:
            path = self.path / name
            if not path.is_file():
                raise FileNotFoundError(name)
            try:
                with safe_open(str(path), framework="pt") as f:
                    headers = {}
                    for key in f.keys():
                        sl = f.get_slice(key)
                        headers[key] = TensorHeader(sl.get_dtype(), tuple(sl.get_shape()))
            except Exception as err:  # safetensors raises its own error types for corrupt files
                size = path.stat().st_size
                raise ShardFileError(f"HF checkpoint {self.path}: cannot read the header of {name} ({size} bytes; "
                                     f"truncated or damaged?): {err}", "", name) from None
            self._headers[name] = headers
        return self._headers[name]

    def header(self, key: str) -> TensorHeader:
        """dtype and shape of ``key`` from its shard's header (no tensor data is read)."""
        name = self._weight_map[key]
        try:
            headers = self._file_headers(name)
        except FileNotFoundError:
            raise MissingShardFile(
                f"HF checkpoint {self.path}: key {key!r} is mapped to shard file {name!r}, which does not exist",
                key, name,
            ) from None
        if key not in headers:
            raise ValueError(
                f"HF checkpoint {self.path}: key {key!r} is mapped to {name!r}, but that file does not contain it"
            )
        return headers[key]

    # ------------------------------------------------------------------ data
    def _handle(self, name: str) -> Any:
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        while len(self._open) >= self._max_open:
            _, old = self._open.popitem(last=False)
            old.__exit__(None, None, None)
        handle = safe_open(str(self.path / name), framework="pt")
        handle.__enter__()
        self._open[name] = handle
        self.files_opened.append(name)
        return handle

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``index`` (one slice per dim) of it, as a new CPU tensor."""
        handle = self._handle(self._weight_map[key])
        self.keys_read.append(key)
        if index is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]

    def close(self) -> None:
        while self._open:
            _, handle = self._open.popitem(last=False)
            handle.__exit__(None, None, None)

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
