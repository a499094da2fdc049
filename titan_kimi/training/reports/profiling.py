"""The [profiling] section at work: torch.profiler around chosen training steps, per rank.

Each profiled step writes, under ``job.dump_folder/<profiling.folder>/step-<N>/``: ``rank<R>.trace.json.gz``
(chrome trace), ``rank<R>.kernels.txt`` (the op/kernel table by self device time) and ``rank<R>.summary.json``
(training/reports/profile_summary.py). Rank 0 gathers every rank's summary for the log and metrics.jsonl.
"""

from __future__ import annotations

import gzip
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from titan_kimi.training.reports.metrics import peak_memory_gib
from titan_kimi.training.reports.profile_summary import STEP_ANNOTATION, StepProfile, summarize_trace

KERNEL_TABLE_ROWS = 60


class StepProfiler:
    def __init__(self, enable: bool, steps: list[int], folder: Path, total_steps: int, rank: int,
                 device: torch.device) -> None:
        self.enable, self.folder, self.rank, self.device = enable, folder, rank, device
        self.steps = {total_steps if s == -1 else s for s in steps} if enable else set()

    def wants(self, step: int) -> bool:
        return step in self.steps

    @contextmanager
    def around(self, step: int) -> Iterator[list[StepProfile]]:
        """Profiles the body when ``step`` is chosen; the yielded list then holds this rank's summary."""
        found: list[StepProfile] = []
        if not self.wants(step):
            yield found
            return
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            with record_function(STEP_ANNOTATION):
                yield found
        found.append(self._write(prof, step, cuda))

    def _write(self, prof: profile, step: int, cuda: bool) -> StepProfile:
        out = self.folder / f"step-{step}"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"rank{self.rank}.trace.json.gz"
        prof.export_chrome_trace(str(trace))  # gzipped: the name ends in .gz
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=KERNEL_TABLE_ROWS)
        (out / f"rank{self.rank}.kernels.txt").write_text(table + "\n", encoding="utf-8")
        with gzip.open(trace, "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        summary = summarize_trace(events, rank=self.rank, step=step, device_type=self.device.type,
                                  peak_mem_gib=peak_memory_gib(self.device))
        (out / f"rank{self.rank}.summary.json").write_text(json.dumps(summary.as_dict()) + "\n", encoding="utf-8")
        return summary


def gather_profiles(mine: StepProfile) -> list[StepProfile]:
    """Every rank's summary of the step, in rank order (every rank profiles the same steps)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered: list[StepProfile | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [p for p in gathered if p is not None]
