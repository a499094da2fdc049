"""Saying what went wrong when writing a checkpoint failed: a full disk is named as such, with the free space.

DCP wraps the writers' exceptions in a ``CheckpointException`` (per rank, with tracebacks) and safetensors in
its own error type, so "No space left on device" is buried; this finds it.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull")


def _causes(err: BaseException):
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def is_out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or anything it wraps) is a full disk or an exceeded quota."""
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if not isinstance(e, OSError) and any(text in str(e) for text in _NO_SPACE_TEXT):
            return True  # safetensors' SafetensorError carries the OS error as text
    return False


def free_space(path: str | Path) -> str:
    """Free space on the file system holding ``path`` (or its nearest existing parent), e.g. "1.2 GiB"."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"


def describe_write_failure(err: BaseException, where: str | Path) -> str:
    """One line for a full disk, else the error itself."""
    if is_out_of_space(err):
        return (f"no space left on the device holding {where} ({free_space(where)} free now); free space or "
                f"write elsewhere (job.dump_folder / checkpoint.folder, or the output path)")
    return str(err)
