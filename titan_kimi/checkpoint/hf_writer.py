"""Write an HF safetensors folder shard by shard, atomically: everything goes to a hidden temporary folder that
is renamed into place only when complete, so a crash never leaves a half-written checkpoint under ``path``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titan_kimi.checkpoint.hf_index import INDEX_FILE
from titan_kimi.checkpoint.storage_errors import describe_write_failure, is_out_of_space

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class HFShardWriter:
    """``add(key, tensor)`` tensors in order; a shard is written once the next tensor would exceed
    ``max_shard_bytes``, so host memory holds at most one shard. ``commit(extra_files)`` finishes the folder.

    ``enabled=False`` (non-writing ranks of a distributed export) accepts and drops everything.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        enabled: bool = True,
    ) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.enabled = enabled
        self.tmp = self.path.parent / f".{self.path.name}.tmp"
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._keys: set[str] = set()
        self.total_bytes = 0
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())) and not overwrite:
            raise ValueError(
                f"export target {str(self.path)!r} already exists and is not empty; pass overwrite=True to replace it"
            )
        if enabled:
            shutil.rmtree(self.tmp, ignore_errors=True)  # left over from a crashed export
            self.tmp.mkdir(parents=True)

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
        return f"part-{i:05d}.safetensors"

    def _flush(self) -> None:
        if not self._pending:
            return
        try:
            save_file(self._pending, str(self.tmp / self._part_name(len(self._shards))), metadata={"format": "pt"})
        except Exception as err:  # safetensors reports a full disk as text inside its own error type
            if not is_out_of_space(err):
                raise
            raise RuntimeError(f"HF export to {self.path} failed, nothing was replaced: "
                               f"{describe_write_failure(err, self.tmp)}") from None
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def commit(self, extra_files: dict[str, Any] | None = None) -> Path:
        """Write the last shard, the index and ``extra_files`` (name -> JSON object), then move into place."""
        if not self.enabled:
            return self.path
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, keys in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp / self._part_name(i), self.tmp / name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for name, content in (extra_files or {}).items():
            (self.tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        old = self.path.parent / f".{self.path.name}.old"
        if self.path.exists():
            if any(self.path.iterdir()) and not self.overwrite:
                raise ValueError(f"export target {str(self.path)!r} appeared while exporting; not replacing it")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)  # the atomic step
        shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        self._pending = {}
        if self.enabled:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "HFShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
