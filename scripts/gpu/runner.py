"""The GPU measurement driver's plumbing, imported by scripts/gpu/measure.py (not run on its own).

It runs a part's commands under time limits, logs them, and archives the work folder into $OUT after every
command.

The GPU machine hands back only a few files from $OUT, at most two folders deep, so every log, metrics file and
table lives in the work folder and travels as one archive, ``$OUT/all.tgz``, rewritten after each command: a
run cut short by its time limit still brings back what finished.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Command:
    """One command of a part: what runs, its time limit, where its output goes."""

    cmd: list[str]
    log: Path
    timeout: int
    env: dict[str, str] = field(default_factory=dict)
    interrupt: bool = False  # SIGINT first (pytest then writes its summary), SIGKILL 20 s later

    def line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env + ' ' if env else ''}timeout {self.timeout} {shlex.join(self.cmd)} > {self.log}"


@dataclass
class _Started:
    command: Command
    proc: subprocess.Popen
    log: IO[str]


class Runner:
    """Runs commands for the parts; with ``dry_run`` only prints what each would run."""

    def __init__(self, out: Path, work: Path, env: dict[str, str], dry_run: bool) -> None:
        self.out, self.work, self.env, self.dry_run = out, work, env, dry_run
        self.started = time.monotonic()
        self.gpu_count: int | None = None  # set by measure.py from nvidia-smi (or NGPUS)
        if not dry_run:
            out.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)

    def folder(self, part: str) -> Path:
        """A part's folder in the work folder (made when its first log is written)."""
        return self.work / part

    def note(self, text: str) -> None:
        print(text, flush=True)
        if not self.dry_run:
            with open(self.work / "measure.log", "a", encoding="utf-8") as f:
                f.write(text + "\n")

    def run(self, label: str, command: Command) -> int:
        """Runs one command to its end or its limit, then archives; returns its exit status."""
        if self.dry_run:
            self.note(f"[{label}] {command.line()}")
            return 0
        return self.finish(label, self.start(command))

    def run_side_by_side(self, labelled: list[tuple[str, Command]]) -> list[int]:
        """Runs the commands at the same time (e.g. one per GPU) and waits for all of them."""
        if self.dry_run:
            for label, command in labelled:
                self.note(f"[{label}] (side by side) {command.line()}")
            return [0] * len(labelled)
        running = [(label, self.start(command)) for label, command in labelled]
        return [self.finish(label, started) for label, started in running]

    def start(self, command: Command) -> _Started:
        command.log.parent.mkdir(parents=True, exist_ok=True)
        signal = ["-s", "INT", "-k", "20"] if command.interrupt else ["-k", "20"]
        log = open(command.log, "w", encoding="utf-8")
        proc = subprocess.Popen(["timeout", *signal, str(command.timeout), *command.cmd], cwd=ROOT,
                                env={**self.env, **command.env}, stdout=log, stderr=subprocess.STDOUT)
        return _Started(command, proc, log)

    def finish(self, label: str, started: _Started) -> int:
        rc = started.proc.wait()
        started.log.close()
        limit = " (time limit)" if rc in (124, 137) else ""
        self.note(f"[{label}] rc={rc}{limit} at {self.elapsed()} s -> {started.command.log.relative_to(self.work)}")
        self.archive()
        return rc

    def elapsed(self) -> int:
        return int(time.monotonic() - self.started)

    def archive(self) -> None:
        """Everything in the work folder but chrome traces (they travel in traces.tar) into $OUT/all.tgz."""
        if self.dry_run:
            return
        part = self.out / "all.tgz.part"
        with tarfile.open(part, "w:gz") as tar:
            tar.add(self.work, arcname=".", filter=lambda info: None if info.name.endswith(".trace.json.gz") else info)
        part.replace(self.out / "all.tgz")

    def tail(self, path: Path, lines: int, pattern: str = "") -> None:
        """Prints the last lines of a log (those containing ``pattern`` when given) into the driver's output."""
        if self.dry_run or not path.is_file():
            return
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if pattern:
            text = [t for t in text if pattern in t]
        for t in text[-lines:]:
            print("    " + t[:400])
        sys.stdout.flush()


def python(script: str, *args: str) -> list[str]:
    """The command line of a script of this repository under the set-up's interpreter."""
    return [sys.executable, script, *args]


def env_int(name: str, default: int) -> int:
    """An integer knob from the environment; anything else stops the driver naming the variable."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if not value.isdigit():
        raise SystemExit(f"measure: {name}={value!r} is not a whole number of seconds or steps")
    return int(value)
