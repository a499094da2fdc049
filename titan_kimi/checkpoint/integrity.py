"""Which data files of a DCP step folder are shorter than its metadata says (a disk that filled, a copy that was
cut, a file deleted), and which entries (model, optimizer, ...) they cost.

DCP's metadata records, for every saved item, the file, offset and length of its bytes; a file that ends before
its last item is damaged, and is found from file sizes alone (no data is read). Damage inside a file of the
right length is not found here; torch's reader fails on it later, and ``unreadable_data`` tells that failure
from others.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata


@dataclass(frozen=True)
class DamagedFile:
    path: Path
    size: int | None  # bytes on disk; None: the file is missing
    needed: int  # bytes its items span, by the metadata
    entries: tuple[str, ...]  # top-level entries (model, optimizer, rng, ...) with items past the end

    def describe(self) -> str:
        have = "is missing" if self.size is None else f"is {self.size} bytes"
        return (f"{self.path} {have}, but the step's metadata places data up to byte {self.needed} in it: it was "
                f"cut short or removed (a full disk, an interrupted copy) and lost data of the "
                f"{' and '.join(repr(e) for e in self.entries)} entries")


def damaged_files(step_dir: str | Path, metadata: Metadata, entries: Iterable[str] | None = None) -> list[DamagedFile]:
    """The files of ``step_dir`` too short for the items the metadata puts in them, restricted to items of the
    top-level ``entries`` (None: all)."""
    wanted = None if entries is None else set(entries)
    needed: dict[str, int] = {}
    lost: dict[str, set[str]] = {}
    sizes: dict[str, int | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        entry = index.fqn.split(".", 1)[0]
        if wanted is not None and entry not in wanted:
            continue
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = os.path.getsize(Path(step_dir) / name)
            except OSError:
                sizes[name] = None
        end = info.offset + info.length
        needed[name] = max(needed.get(name, 0), end)
        size = sizes[name]
        if size is None or size < end:
            lost.setdefault(name, set()).add(entry)
    return [DamagedFile(Path(step_dir) / name, sizes[name], needed[name], tuple(sorted(lost[name])))
            for name in sorted(lost)]


def unreadable_data(err: BaseException) -> BaseException | None:
    """The error of torch's reader on a data file's bytes (a zip archive or pickle it cannot read) behind ``err``
    (``err`` itself, or the error of every failed rank of a DCP ``CheckpointException``); None when something
    else failed."""
    if isinstance(err, CheckpointException):
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
        unreadable = [c for c in causes if isinstance(c, BaseException) and unreadable_data(c) is not None]
        return unreadable[0] if unreadable and len(unreadable) == len(causes) else None
    if isinstance(err, (EOFError, pickle.UnpicklingError)) or "PytorchStreamReader" in str(err):
        return err
    return None
