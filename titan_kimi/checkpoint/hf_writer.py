"""Write an HF safetensors folder shard by shard, atomically: everything goes to a hidden temporary folder that
is renamed into place only when complete, so a crash never leaves a half-written checkpoint under ``path``.

Several writers may fill one temporary folder (the stages of a pipelined export, ``hf_export_stages``): each
writes its own ``<prefix>-NNNNN.safetensors`` parts, and one process commits them all (``commit_folder``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from titan_kimi.checkpoint.hf_index import INDEX_FILE
from titan_kimi.checkpoint.storage_errors import describe_write_failure, is_out_of_space

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


@dataclass(frozen=True)
class ShardPart:
    """One written shard in the temporary folder: its file name there, its keys and their bytes."""

    file: str
    keys: tuple[str, ...]
    nbytes: int


def tmp_folder(path: str | Path) -> Path:
    """The hidden folder an export of ``path`` is written to before the atomic rename."""
    path = Path(path)
    return path.parent / f".{path.name}.tmp"


def check_target(path: str | Path, overwrite: bool) -> None:
    """ValueError when ``path`` holds something and ``overwrite`` is False."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise ValueError(
            f"export target {str(path)!r} already exists and is not empty; pass overwrite=True to replace it"
        )


def prepare_tmp(path: str | Path, overwrite: bool) -> Path:
    """Check the target and start an empty temporary folder (removing one left by a crashed export)."""
    check_target(path, overwrite)
    tmp = tmp_folder(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_folder(path: str | Path, parts: Sequence[ShardPart], extra_files: dict[str, Any] | None = None, *,
                  overwrite: bool = False) -> Path:
    """Rename ``parts`` (in this order) to ``model-0000i-of-0000N.safetensors``, write the index and
    ``extra_files`` (name -> JSON object) into the temporary folder, then move it into place."""
    path, tmp = Path(path), tmp_folder(path)
    n = len(parts)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / part.file, tmp / name)
        for key in part.keys:
            if key in weight_map:
                raise ValueError(f"HF export: key {key!r} written twice")
            weight_map[key] = name
    index = {"metadata": {"total_size": sum(p.nbytes for p in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for name, content in (extra_files or {}).items():
        (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    old = path.parent / f".{path.name}.old"
    if path.exists():
        if any(path.iterdir()) and not overwrite:
            raise ValueError(f"export target {str(path)!r} appeared while exporting; not replacing it")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)  # the atomic step
    shutil.rmtree(old, ignore_errors=True)
    return path


class HFShardWriter:
    """``add(key, tensor)`` tensors in order; a shard is written once the next tensor would exceed
    ``max_shard_bytes``, so host memory holds at most one shard. ``commit(extra_files)`` finishes the folder.

    ``enabled=False`` (non-writing ranks of a distributed export) accepts and drops everything.
    ``prepare=False``: the temporary folder was started by another process (``prepare_tmp``); this writer adds
    its parts named ``<part_prefix>-NNNNN.safetensors`` and ``finish()`` returns them for ``commit_folder``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        enabled: bool = True,
        prepare: bool = True,
        part_prefix: str = "part",
    ) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.enabled = enabled
        self.tmp = tmp_folder(self.path)
        self.part_prefix = part_prefix
        self._prepared = prepare
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[ShardPart] = []
        self._keys: set[str] = set()
        self.total_bytes = 0
        if prepare:
            check_target(self.path, overwrite)
            if enabled:
                prepare_tmp(self.path, overwrite)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._keys:
            raise ValueError(f"HF export: key {key!r} written twice")
        self._keys.add(key)
        if not self.enabled:
            return
        # A private contiguous CPU copy: safetensors refuses tensors that share storage (w1/w3 rows of one w13).
        value = tensor.detach().to(device="cpu", copy=True).contiguous()
        nbytes = value.numel() * value.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[key] = value
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _part_name(self, i: int) -> str:
        return f"{self.part_prefix}-{i:05d}.safetensors"

    def _flush(self) -> None:
        if not self._pending:
            return
        name = self._part_name(len(self._shards))
        try:
            save_file(self._pending, str(self.tmp / name), metadata={"format": "pt"})
        except Exception as err:  # safetensors reports a full disk as text inside its own error type
            if not is_out_of_space(err):
                raise
            raise RuntimeError(f"HF export to {self.path} failed, nothing was replaced: "
                               f"{describe_write_failure(err, self.tmp)}") from None
        nbytes = sum(t.numel() * t.element_size() for t in self._pending.values())
        self._shards.append(ShardPart(name, tuple(self._pending), nbytes))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[ShardPart]:
        """Write the last shard; the parts this writer wrote (none when disabled)."""
        if not self.enabled:
            return []
        self._flush()
        return list(self._shards)

    def commit(self, extra_files: dict[str, Any] | None = None) -> Path:
        """Write the last shard, the index and ``extra_files`` (name -> JSON object), then move into place."""
        if not self.enabled:
            return self.path
        return commit_folder(self.path, self.finish(), extra_files, overwrite=self.overwrite)

    def abort(self) -> None:
        self._pending = {}
        if self.enabled and self._prepared:  # a shared folder is removed by the process that started it
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "HFShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
