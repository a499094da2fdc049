"""Shared by the GPU benchmarks in scripts/: the median CUDA-event time of a callable, a relative error, and the
installed versions of the packages a benchmark depends on."""

from __future__ import annotations

import importlib.metadata
import statistics
from typing import Callable

import torch


def median_cuda_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median over ``repeats`` calls of ``fn`` (after ``warmup`` untimed ones), in ms between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32 (Frobenius norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def package_versions(packages: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """The installed version of each distribution, None where it is not installed."""
    versions: dict[str, str | None] = {}
    for p in packages:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    return versions
