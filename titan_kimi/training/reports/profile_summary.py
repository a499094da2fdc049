"""Reading a profiled step's chrome trace: which events are communication, and the step's time shares.

Kept free of the profiler itself, so the classification and the arithmetic are tested on synthetic events.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

STEP_ANNOTATION = "titan_kimi_train_step"  # the record_function around a profiled step (the step window)
NCCL_KERNEL_PREFIXES = ("ncclDevKernel", "ncclKernel")
# Host-side collectives on CPU: c10d's dispatcher ops (c10d::allreduce_, _c10d_functional::all_gather_into_tensor,
# wait_tensor), gloo's own record_functions (gloo:all_reduce) and the profiler's comms record.
HOST_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "record_param_comms")
NOT_COMM_SUFFIXES = ("_wrap_tensor_autograd",)  # functional collectives' autograd wrapper: no data moves
DEVICE_TYPES = ("cuda", "cpu")


def is_communication(name: str, category: str, device_type: str) -> bool:
    """Whether a trace event is communication: on CUDA an NCCL kernel (the GPU time the collectives take; their
    host launches are not counted), on CPU a c10d / gloo host op (gloo runs collectives on the host)."""
    if device_type == "cuda":
        return category == "kernel" and name.startswith(NCCL_KERNEL_PREFIXES)
    if device_type == "cpu":
        return (category in ("cpu_op", "user_annotation") and name.startswith(HOST_COMM_PREFIXES)
                and not name.endswith(NOT_COMM_SUFFIXES))
    raise ValueError(f"device_type = {device_type!r}; valid: {'|'.join(DEVICE_TYPES)}")


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of [start, end) intervals clipped to [lo, hi): overlapping (nested, concurrent)
    events count once, so the shares stay in [0, 1]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass(frozen=True)
class StepProfile:
    rank: int
    step: int
    step_time_s: float        # the step window (the record_function around the step)
    cuda_busy_s: float | None  # union of all CUDA kernels in the window; None on CPU
    comm_s: float             # union of the communication events in the window
    comm_share: float         # comm_s / step_time_s
    peak_mem_gib: float = 0.0  # this rank's peak (metrics.jsonl's peak_mem_gib is rank 0's alone)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        busy = f"{self.cuda_busy_s:.4f}s" if self.cuda_busy_s is not None else "n/a (CPU)"
        return (f"profile step {self.step} rank {self.rank}: step {self.step_time_s:.4f}s  cuda busy {busy}  "
                f"communication {self.comm_s:.4f}s = {100 * self.comm_share:.1f}% of the step  "
                f"peak {self.peak_mem_gib:.2f} GiB")


def summarize_trace(events: list[dict], *, rank: int, step: int, device_type: str,
                    peak_mem_gib: float = 0.0) -> StepProfile:
    """The step's profile from chrome-trace events (``traceEvents``; ts and dur in microseconds)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # The host's range (the CUDA timeline repeats it as a gpu_user_annotation); the step ends with a device sync,
    # so the kernels it launched finish inside it.
    windows = [e for e in complete if e.get("name") == STEP_ANNOTATION and e.get("cat") == "user_annotation"]
    if not windows:
        raise ValueError(f"no {STEP_ANNOTATION!r} event in the trace of step {step}, rank {rank}")
    lo = min(float(e["ts"]) for e in windows)
    hi = max(float(e["ts"]) + float(e["dur"]) for e in windows)
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    comm = union_length((span(e) for e in complete
                         if is_communication(str(e.get("name", "")), str(e.get("cat", "")), device_type)), lo, hi)
    busy = (union_length((span(e) for e in complete if e.get("cat") == "kernel"), lo, hi) / 1e6
            if device_type == "cuda" else None)
    window = hi - lo
    return StepProfile(rank=rank, step=step, step_time_s=window / 1e6, cuda_busy_s=busy, comm_s=comm / 1e6,
                       comm_share=comm / window if window > 0 else 0.0, peak_mem_gib=peak_mem_gib)
