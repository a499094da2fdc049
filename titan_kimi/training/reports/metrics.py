"""Per-step metrics: a log line, a progress bar on long runs, metrics.jsonl, TensorBoard, a final summary."""

from __future__ import annotations

import json
import logging
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("titan_kimi")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens the step ran over the global batch, padding included (fewer where it is trimmed)
    step_time: float
    tokens_per_sec: float
    tokens_per_sec_per_device: float
    mfu: float
    peak_mem_gib: float
    skipped: bool = False
    expert_load_max: float | None = None  # most loaded expert / balanced share (worst MoE layer)
    expert_load_min: float | None = None  # least loaded expert / balanced share (worst MoE layer)
    images: int = 0  # images in the global batch (image-text data)
    images_per_sec: float = 0.0
    # indexer.mode warmup / sparse, on logging steps: mean KL per query and DSA layer since the last logging
    # step, and the recall (mass of the main attention inside the top-k) of this step
    indexer_kl: float | None = None
    indexer_recall: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class MetricsLogger:
    """Writes only on rank 0 (metrics are already reduced over ranks)."""

    dump_folder: Path
    log_freq: int
    save_jsonl: bool
    tensorboard: bool
    progress: str  # auto | on | off
    total_steps: int
    is_main: bool = True
    history: list[StepMetrics] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._jsonl = None
        self._tb = None
        self._start = time.perf_counter()
        if not self.is_main:
            return
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        if self.save_jsonl:
            self._jsonl = open(self.dump_folder / "metrics.jsonl", "a", encoding="utf-8")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dump_folder / "tb"))
        self._bar = self.progress == "on" or (self.progress == "auto" and sys.stderr.isatty())

    def log(self, m: StepMetrics) -> None:
        self.history.append(m)
        if not self.is_main:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(m.as_dict()) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in m.as_dict().items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, m.step)
        if self._bar:
            self._draw_bar(m)
        if m.step % self.log_freq == 0 or m.step == self.total_steps:
            note = "  (step skipped: non-finite gradients)" if m.skipped else ""
            if m.expert_load_max is not None:
                note = f"  experts {m.expert_load_min:.2f}-{m.expert_load_max:.2f}x{note}"
            if self._bar:
                sys.stderr.write("\n")
            if m.indexer_kl is not None:
                recall = f" recall {m.indexer_recall:.3f}" if m.indexer_recall is not None else ""
                note = f"  indexer kl {m.indexer_kl:.4f}{recall}{note}"
            images = f"  img/s {m.images_per_sec:.1f}" if m.images else ""
            logger.info(
                "step %d  loss %.4f  grad_norm %.3f  lr %.2e  tok/s %.0f%s  mfu %.2f%%  mem %.2f GiB  step %.3fs%s",
                m.step, m.loss, m.grad_norm, m.lr, m.tokens_per_sec, images, 100 * m.mfu, m.peak_mem_gib,
                m.step_time, note,
            )

    def log_validation(self, step: int, loss: float, tokens: int) -> None:
        if not self.is_main:
            return
        logger.info("validation at step %d  loss %.4f  (%d tokens)", step, loss, tokens)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "validation_loss": loss, "validation_tokens": tokens}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.add_scalar("validation_loss", loss, step)

    def log_profiles(self, step: int, profiles: list[Any]) -> None:
        """One line per rank of a profiled step (training/profile_summary.StepProfile), and one metrics.jsonl
        record {"step", "profile": [per-rank dicts]}."""
        if not self.is_main:
            return
        for p in profiles:
            logger.info("%s", p.line())
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "profile": [p.as_dict() for p in profiles]}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for p in profiles:
                self._tb.add_scalar(f"profile/comm_share_rank{p.rank}", p.comm_share, step)

    def _draw_bar(self, m: StepMetrics) -> None:
        width = 30
        done = int(width * m.step / max(1, self.total_steps))
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(1, len(self.history)) * (self.total_steps - m.step)
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {m.step}/{self.total_steps} loss {m.loss:.4f} eta {eta:.0f}s "
        )
        sys.stderr.flush()

    def summary(self) -> str:
        """One line: steps, first/last loss, median step time, tokens/s and MFU over steps after the first."""
        if not self.history:
            return "summary: no steps run"
        steady = self.history[1:] or self.history
        med = lambda key: statistics.median(getattr(m, key) for m in steady)
        return (
            f"summary: steps={self.history[-1].step} first_loss={self.history[0].loss:.4f} "
            f"final_loss={self.history[-1].loss:.4f} median_step_time={med('step_time'):.4f}s "
            f"median_tokens_per_sec={med('tokens_per_sec'):.1f} "
            + (f"median_images_per_sec={med('images_per_sec'):.2f} " if self.history[-1].images else "")
            + f"median_mfu={100 * med('mfu'):.3f}% "
            f"peak_mem_gib={max(m.peak_mem_gib for m in self.history):.2f} "
            f"skipped_steps={sum(m.skipped for m in self.history)}"
        )

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class _CurrentStdout(logging.StreamHandler):
    """Writes each record to whatever ``sys.stdout`` is then: a harness that swaps stdout (pytest's capture, a
    launcher) must not leave the trainer's logging bound to a closed stream."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[_CurrentStdout()], force=True)
