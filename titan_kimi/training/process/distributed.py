"""Process-group setup from the launcher's environment (torchrun) and small collective helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        def read(name: str, default: int) -> int:
            value = os.environ.get(name, str(default))
            if not value.isdigit():
                raise ValueError(f"environment variable {name}={value!r} must be a non-negative integer")
            return int(value)

        return cls(read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0))

    @property
    def launched(self) -> bool:
        """Started by torchrun (or another launcher that sets the env:// variables)."""
        return "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(env: DistEnv, device: torch.device) -> None:
    """NCCL on GPU, gloo on CPU; a no-op for a plain single process."""
    if not env.launched or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=30),
                            device_id=device if device.type == "cuda" else None)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


_host_group: dist.ProcessGroup | None = None


def host_group() -> dist.ProcessGroup | None:
    """A gloo group over every rank for collectives of host numbers (the default group when it is gloo already):
    they block the host alone, never wait for the device's queue, and copy nothing to or from it."""
    global _host_group
    if dist.get_backend() == "gloo":
        return None  # the default group
    if _host_group is None:
        _host_group = dist.new_group(backend="gloo")
    return _host_group


def host_all_reduce(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """``values`` (host numbers) reduced with ``op`` over every rank on the host, in float64 (exact for integers
    below 2**53, in any order); unchanged in a plain single process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=host_group())
    return tensor.tolist()


def destroy() -> None:
    global _host_group
    _host_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
