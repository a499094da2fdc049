"""Helpers the benchmarks import (not run on its own): median CUDA-event or wall-clock times, peak memory,
relative errors, installed package versions."""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from typing import Callable

import torch


def cuda_times_ms(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """``repeats`` calls of ``fn`` (after ``warmup`` untimed ones), each in ms between CUDA events."""
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
    return times


def median_cuda_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median over ``repeats`` calls of ``fn`` (after ``warmup`` untimed ones), in ms between CUDA events."""
    return statistics.median(cuda_times_ms(fn, warmup, repeats))


def peak_mib(fn: Callable[[], object]) -> float:
    """The peak CUDA memory of one call of ``fn`` above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def wall_ms_and_peak(fn: Callable[[], object], reps: int, device: torch.device) -> tuple[float, float]:
    """Median wall ms over ``reps`` synchronised calls after one warm-up, and their peak memory in MiB above
    what was allocated before them (nan on CPU, where the benchmarks run only as a smoke test)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def write_rows(path: str, rows: list[dict], device: torch.device) -> None:
    """The benchmark's rows as JSON, with the device's name and torch's version."""
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


def cell(row: dict, key: str, fmt: str) -> str:
    """A table cell: ``row[key]`` formatted, or a dash where the case did not produce it."""
    return format(row[key], fmt) if key in row else "—"


def write_markdown(path: str, title: str, columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """``# title`` and a table of ``rows``, one column per ``(header, key, format)`` (``cell``), written to ``path``;
    returns the text."""
    lines = [f"# {title}", "", "| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, key, fmt) for _, key, fmt in columns) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


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
