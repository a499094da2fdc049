"""A dependency-free progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call with ``(done, total)``; usable directly as the ``progress`` callback of the loaders and exporters."""

    def __init__(self, label: str, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.label, self.width = label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_decile = -1
        self._last_draw = 0.0

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        fraction = min(done / total, 1.0)
        elapsed = time.monotonic() - self.start
        if self.tty:
            now = time.monotonic()
            if done < total and now - self._last_draw < 0.1:  # redraw at most 10 times a second
                return
            self._last_draw = now
            filled = int(fraction * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {fraction:4.0%} {elapsed:6.1f}s{end}")
        else:
            decile = int(fraction * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(f"{self.label}: {done}/{total} ({fraction:.0%}) {elapsed:.1f}s\n")
        self.stream.flush()
