"""Where a step's compile time went: torch.compile's phases and this process's Triton JIT compiles.

The first step of a compiled run is mostly compilation (Dynamo tracing, Inductor code generation, Triton kernels
of FLA / liger / lowerings, CUDA-graph recording). This logs, for the first step and any later step that compiled
again, how its wall time divides, so a slow start names its cause instead of being one opaque number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from titan_kimi.training.process.start_time import process_start_time


def _torch_compile_seconds() -> dict[str, float]:
    try:
        from torch._dynamo.utils import calculate_time_spent, counters
    except ImportError:  # a torch without Dynamo's timers: report nothing rather than fail the run
        return {}
    phases = dict(calculate_time_spent())
    phases["graphs"] = float(counters["stats"].get("unique_graphs", 0))
    phases["cache_hits"] = float(counters["inductor"].get("fxgraph_cache_hit", 0))
    phases["cache_misses"] = float(counters["inductor"].get("fxgraph_cache_miss", 0))
    return phases


@dataclass
class TritonJitClock:
    """Counts and times the Triton JIT compiles made in this process (cache hits from disk included), through
    Triton's ``jit_cache_hook`` / ``jit_post_compile_hook`` knobs; hooks already installed keep running."""

    kernels: int = 0
    seconds: float = 0.0
    _started: dict[Any, float] = field(default_factory=dict)
    _previous: tuple[Callable | None, Callable | None] = (None, None)
    installed: bool = False

    def install(self) -> "TritonJitClock":
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU build): nothing to time
            return self
        runtime = knobs.runtime
        before_cache, before_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._previous = (before_cache, before_post)

        def on_start(*args: Any, **kwargs: Any) -> bool:
            self._started[repr(kwargs.get("key"))] = time.perf_counter()
            # a true return tells Triton to skip the compile: defer to a hook that was there before
            return bool(before_cache(*args, **kwargs)) if before_cache is not None else False

        def on_done(*args: Any, **kwargs: Any) -> Any:
            began = self._started.pop(repr(kwargs.get("key")), None)
            if began is not None:
                self.kernels += 1
                self.seconds += time.perf_counter() - began
            return before_post(*args, **kwargs) if before_post is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_done
        self.installed = True
        return self

    def uninstall(self) -> None:
        if self.installed:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous
            self.installed = False


class CompileReport:
    """Snapshot the compile counters around each step; `line` describes a step that compiled (None otherwise)."""

    def __init__(self, launched_at: float | None = None) -> None:
        self.launched_at = process_start_time() if launched_at is None else launched_at
        self.triton = TritonJitClock().install()
        self._torch = _torch_compile_seconds()
        self._triton = (0, 0.0)

    def line(self, step: int, step_seconds: float) -> str | None:
        """The step's breakdown; None for a step after the first that compiled nothing."""
        compiled, jit, parts = self.since_last()
        if compiled < 0.5 and jit < 0.5 and step != 1:
            return None
        head = f"step {step} took {step_seconds:.1f} s"
        if step == 1 and self.launched_at is not None:
            head += f" (finished {time.time() - self.launched_at:.0f} s after this process started)"
        if parts:  # something compiled: say what the remainder was
            parts.append(f"the rest {step_seconds - compiled - jit:.1f} s (running, autotuning, CUDA-graph recording)")
        return "; ".join([head, *parts])

    def since_last(self) -> tuple[float, float, list[str]]:
        """Seconds of torch.compile and of Triton JIT since the last call, and their description (empty when
        nothing compiled)."""
        now_torch = _torch_compile_seconds()
        delta = {k: now_torch.get(k, 0.0) - self._torch.get(k, 0.0) for k in now_torch}
        kernels, seconds = self.triton.kernels - self._triton[0], self.triton.seconds - self._triton[1]
        self._torch, self._triton = now_torch, (self.triton.kernels, self.triton.seconds)
        compiled = delta.get("total_wall_time", 0.0)
        parts = []
        if compiled > 0 or delta.get("graphs", 0) > 0:
            parts.append(
                f"torch.compile {compiled:.1f} s over {int(delta.get('graphs', 0))} new graphs "
                f"(Dynamo frames {delta.get('entire_frame_compile', 0.0):.1f} s, their Inductor compiles "
                f"{delta.get('inductor_compile', 0.0):.1f} s of it, waiting on kernel workers "
                f"{delta.get('async_compile.wait', 0.0):.1f} s of that; lazily compiled backwards "
                f"{delta.get('entire_backward_compile', 0.0):.1f} s; Inductor's graph cache "
                f"{int(delta.get('cache_hits', 0))} hits, {int(delta.get('cache_misses', 0))} misses)")
        if kernels:
            parts.append(f"Triton JIT in this process {seconds:.1f} s over {kernels} kernels")
        return compiled, seconds, parts

    def close(self) -> None:
        self.triton.uninstall()
