"""Timing and memory of GPU (or CPU) work for the rank-slice benchmark: CUDA events on a GPU, the wall clock
(after the work) on a CPU; the device allocator's counters where there are some."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


class Stopwatch:
    """Marks on one device; ``ms(a, b)`` is the time between two marks once ``wait()`` returned."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def wait(self) -> None:
        if self.cuda and self._marks:
            self._marks[-1].synchronize()

    def ms(self, a: int, b: int) -> float:
        if self.cuda:
            return self._marks[a].elapsed_time(self._marks[b])
        return (self._marks[b] - self._marks[a]) * 1e3


def median_phases(step: Callable[[Stopwatch], list[int]], device: torch.device, warmup: int,
                  repeats: int) -> list[float]:
    """Median ms of each phase of ``step`` (which marks the phase boundaries on the stopwatch it gets and returns
    the marks), over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        watch = Stopwatch(device)
        step(watch)
        watch.wait()
    runs: list[list[float]] = []
    for _ in range(repeats):
        watch = Stopwatch(device)
        marks = step(watch)
        watch.wait()
        runs.append([watch.ms(a, b) for a, b in zip(marks, marks[1:])])
    return [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30
