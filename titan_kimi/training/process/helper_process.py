"""A background helper process of the trainer (the prewarms): not a rank of the job, its output kept in a file.

The prewarm processes share nothing with training but the on-disk compile caches, so whatever happens to one
costs at most the time it would have saved; `HelperProcess.finish` reports how it ended for the log.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parents[3]
# The launcher's variables that would make a helper take itself for a rank of the job.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")


@dataclass(frozen=True)
class Outcome:
    status: str  # "done", "failed" or "stopped" (still running when finish gave up on it)
    returncode: int
    line: str  # the helper's last result line (see `HelperProcess.finish`)


class HelperProcess:
    """``command`` started now, with this checkout importable and the job's rank variables removed; its output goes
    to a temporary file, not a pipe, so a chatty helper never blocks on a full pipe. With ``stdin`` it reads a
    pipe that `send_line` writes once (the helper sees end of file if this process dies first)."""

    def __init__(self, name: str, command: list[str], *, stdin: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))
        self.name = name
        self._output = tempfile.TemporaryFile(mode="w+")
        self.popen = subprocess.Popen(command, env=env, stdout=self._output, stderr=subprocess.STDOUT, text=True,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)

    def running(self) -> bool:
        return self.popen.poll() is None

    def send_line(self, line: str) -> bool:
        """Write ``line`` to the helper's stdin and close it; False if it is not reading any more."""
        pipe = self.popen.stdin
        if pipe is None or pipe.closed:
            raise ValueError(f"helper {self.name!r}: its stdin was not opened, or was sent a line already")
        try:
            pipe.write(line.rstrip("\n") + "\n")
            pipe.close()
            return True
        except (BrokenPipeError, OSError):
            return False

    def finish(self, timeout_s: float, *, result_prefix: str = "") -> Outcome:
        """Wait up to ``timeout_s`` (then kill it) and read its output: ``line`` is the last line that starts with
        ``result_prefix`` (prefix removed; other processes' logs can share the file), else the last line."""
        stopped = False
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            try:  # a helper still waiting for its line gets end of file
                self.popen.stdin.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            stopped = True
        self._output.seek(0)
        lines = self._output.read().strip().splitlines()
        self._output.close()
        ours = [line[len(result_prefix):] for line in lines if result_prefix and line.startswith(result_prefix)]
        line = ours[-1] if ours else (lines[-1] if lines else "(no output)")
        status = "stopped" if stopped else "done" if self.popen.returncode == 0 else "failed"
        return Outcome(status, self.popen.returncode, line)
