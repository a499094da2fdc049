"""Where the time from process start to the first step goes, as one log line.

On the H200 the trainer spends 13-26 s before its first step begins (docs/perf.md), part of the launch-to-first-
step time the recipes are judged by. `StartupClock` names each phase of it (imports, model and optimizer build,
the backend libraries, waiting for prewarm processes), so a slow start says which phase grew.
"""

from __future__ import annotations

import time

from titan_kimi.training.process.start_time import process_start_time


class StartupClock:
    """``mark(name)`` closes the phase that ran since the previous mark (the first one since the process
    started; since the clock was made where the start time is unknown)."""

    def __init__(self, started_at: float | None = None) -> None:
        started = process_start_time() if started_at is None else started_at
        self._since_start = started is not None
        self._last = started if started is not None else time.time()
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append((name, max(0.0, now - self._last)))
        self._last = now

    def line(self) -> str | None:
        """``startup: <phase> <s>, ...; <total> s from process start to the first step``; None before any mark."""
        if not self.phases:
            return None
        total = sum(seconds for _, seconds in self.phases)
        span = "from process start" if self._since_start else "from the clock's start"
        return ("startup: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
                + f"; {total:.1f} s {span} to the first step")
