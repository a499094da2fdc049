"""A table of named trainer runs, each launched once: every run of one world size in one launch
(tests/train_runs_worker.py), started the first time a test asks for any of them.

A run that resumes another's checkpoint launches after it: the launch of its source's world size first, and
within one launch the table's order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tests.test_parallel import launch


@dataclass(frozen=True)
class Run:
    nproc: int  # 0: one plain process; otherwise torchrun with this many ranks
    argv: tuple[str, ...]  # titan_kimi.train's arguments, the dump folder aside
    resumes: tuple[str, str] | None = None  # (run, checkpoint folder name): this run starts from that save


class TrainRuns:
    """``runs.rows(name)``: the metrics.jsonl rows of table[name]; ``runs.losses(name)``: its training losses;
    ``runs.output(name)``: what the launch printed while it ran; ``runs.folder(name)``: its dump folder."""

    def __init__(self, root: Path, table: dict[str, Run]) -> None:
        self.root, self.table = root, table
        self.outputs: dict[str, str] = {}

    def folder(self, name: str) -> Path:
        return self.root / name

    def output(self, name: str) -> str:
        if name not in self.outputs:
            self._launch(self.table[name].nproc)
        return self.outputs[name]

    def rows(self, name: str) -> list[dict]:
        self.output(name)
        return [json.loads(line) for line in (self.folder(name) / "metrics.jsonl").read_text().splitlines()]

    def losses(self, name: str) -> list[float]:
        return [r["loss"] for r in self.rows(name) if "loss" in r]

    def _launch(self, nproc: int) -> None:
        names = [name for name, run in self.table.items() if run.nproc == nproc]
        listing = []
        for name in names:
            copies = []
            if (resumes := self.table[name].resumes) is not None:
                source, save = resumes
                if source not in self.outputs and self.table[source].nproc != nproc:
                    self._launch(self.table[source].nproc)
                copies.append([str(self.folder(source) / "checkpoint" / save),
                               str(self.folder(name) / "checkpoint" / save)])
            listing.append([[*self.table[name].argv, "--job.dump_folder", str(self.folder(name))], copies])
        runs_file = self.root / f"runs_nproc{nproc}.json"
        runs_file.write_text(json.dumps(listing))
        out = launch(["tests/train_runs_worker.py", str(runs_file)], nproc, timeout=3600)
        pieces = re.split(r"^TRAIN_RUN (\d+)$", out, flags=re.MULTILINE)
        printed = {int(index): text for index, text in zip(pieces[1::2], pieces[2::2])}
        for index, name in enumerate(names):
            self.outputs[name] = printed[index]
