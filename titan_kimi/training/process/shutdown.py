"""SIGTERM (what Slurm sends before a kill) and SIGINT end a run cleanly: the step in flight finishes, a
resumable checkpoint is written when checkpointing is on, and the process exits 128 + the signal number with
a log line saying so.

The handler only records the signal; the train loop asks after every step, and all ranks agree (an all-reduce
of the signal number), so a signal that reached one rank stops every rank after the same step. A second
SIGINT stops at once (KeyboardInterrupt), for a user who does not want to wait for the step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch.distributed as dist

from titan_kimi.training.process.distributed import host_all_reduce
from titan_kimi.training.process.exit_codes import RunStopped

logger = logging.getLogger("titan_kimi")

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installed for the span of the training loop (``install()`` ... ``restore()``, or ``with``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the checkpoint
        self.signum = signum
        # os.write, not logging: a handler may run while the logging lock is held.
        os.write(2, f"titan_kimi: received {signal.Signals(signum).name}; finishing the current step, then "
                    f"stopping (saving first when checkpointing is on)\n".encode())

    def agreed(self) -> int | None:
        """The signal any rank received (the largest number if several), or None; a collective."""
        # On the host (a gloo group): asked after every step, it must not wait for the device's queue.
        signum = int(host_all_reduce([float(self.signum or 0)], op=dist.ReduceOp.MAX)[0])
        return signum or None


def stop_run(signum: int, step: int, total: int, checkpointer: Any, state: dict[str, Any], *,
             saved: bool) -> RunStopped:
    """After step ``step`` of ``total``: save ``state`` resumable (unless ``saved`` already did at this step, or
    checkpointing is off) and return the exception that ends the run with exit status 128 + ``signum``."""
    name = signal.Signals(signum).name
    if checkpointer.enable:
        if not saved:
            checkpointer.save(step, state, force=True)
        where = f"resumable checkpoint {checkpointer.step_dir(step)} (rerun the same command to continue)"
    else:
        where = "nothing saved: checkpoint.enable = false"
    message = f"stopped by {name} after step {step} of {total}; {where}; exit status {128 + signum}"
    logger.warning(message)
    return RunStopped(message, 128 + signum)
