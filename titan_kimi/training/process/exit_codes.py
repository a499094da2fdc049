"""How a command-line run ends: a bad input prints its message alone (exit 2), a stop requested by a signal
exits 128 + the signal number, and anything unexpected keeps its traceback.

A "bad input" is a ConfigError, or a ValueError raised by titan_kimi's or lowerings' own code: those messages
are written for users and name the key, file or row. A ValueError raised inside a library is a bug (ours or
theirs) and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from titan_kimi.config import ConfigError

EXIT_BAD_INPUT = 2
_OWN_CODE = tuple(str(Path(__file__).resolve().parents[3] / name) + os.sep for name in ("titan_kimi", "lowerings"))


class RunStopped(Exception):
    """Training stopped early on request (SIGTERM/SIGINT) after finishing a step; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def is_bad_input(err: BaseException) -> bool:
    """A ConfigError, or a ValueError whose innermost frame is in titan_kimi/ or lowerings/."""
    if isinstance(err, ConfigError):
        return True
    if not isinstance(err, ValueError):
        return False
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(_OWN_CODE)


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None,
            *, program: str = "titan_kimi.train") -> int:
    """Runs ``main(argv)`` and turns the ways it can end into an exit status (see the module docstring)."""
    try:
        return main(argv)
    except RunStopped as stop:
        return stop.exit_code
    except Exception as err:
        if not is_bad_input(err):
            raise
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}{program}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
