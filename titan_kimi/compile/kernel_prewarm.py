"""``kernels.prewarm_fla``: compile FLA's KDA kernels in background processes while the trainer starts.

The processes (lowerings/kernels/fla_prewarm.py) run the op at this run's KDA shape on the same GPU and fill
Triton's on-disk cache; the first step then loads the kernels instead of compiling them one after another. They
share the kernels out among themselves (``--claims``: each compiles the ones it reaches first), and share
nothing with training but that cache, so a failure only costs the time they would have saved (logged).

They start at the top of ``python -m titan_kimi.train``, before the trainer imports torch (`FlaPrewarm.spawn_early`:
13-15 s of imports on the H200 machine, which the processes spend importing torch and FLA themselves), and wait
for the shape, which the trainer sends once it has the model's args (`FlaPrewarm.start`). Started then, after the
imports, they finished only with the first step (measured on the H200, 2026-12-02).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from titan_kimi.training.process.helper_process import HelperProcess

if TYPE_CHECKING:  # torch and the model's args load after spawn_early, which must not wait for them
    import torch

    from titan_kimi.config.sections import JobConfig
    from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

logger = logging.getLogger("titan_kimi")

# Triton compiles a kernel on one core. Four processes take the 24 kernels of a k3_small step from ~14 s to a few
# seconds, and leave the other cores of a GPU node to the trainer's own imports and Inductor's compile workers.
PROCESSES = 4
_SCRIPT = [sys.executable, "-m", "lowerings.kernels.fla_prewarm"]
RESULT_PREFIX = "fla_prewarm: "


def shape_arguments(args: KimiK3ModelArgs, cfg: JobConfig) -> list[str]:
    """The shape and dtype arguments of fla_prewarm for model ``args`` under ``cfg`` (one KDA call over the packed
    rows)."""
    t = cfg.training
    dtypes = list(dict.fromkeys([cfg.model.dtype, t.param_dtype]))  # stored, and the compute dtype under FSDP
    command = ["--tokens", str(t.local_batch_size * t.seq_len), "--heads", str(args.kda_num_heads),
               "--head-dim", str(args.kda_head_dim), "--decay-dtypes", *dtypes]
    if args.kda_gate_lower_bound is not None:
        command += ["--lower-bound", repr(float(args.kda_gate_lower_bound))]
    return command


def prewarm_command(args: KimiK3ModelArgs, cfg: JobConfig, device: torch.device) -> list[str]:
    """The whole fla_prewarm command line for model ``args`` under ``cfg``."""
    return [*_SCRIPT, *shape_arguments(args, cfg), "--fla-configs", cfg.kernels.fla_configs, "--device", str(device)]


def _visible_gpu(environ: Mapping[str, str]) -> bool:
    """A GPU is visible to this process, decided without importing torch (the NVIDIA driver's list of GPUs)."""
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def early_unsupported(argv: list[str], environ: Mapping[str, str] = os.environ) -> tuple[str | None, Any]:
    """Why the processes cannot start before the trainer's imports (None when they can), and the job's config.
    Checks only what needs no torch; `FlaPrewarm.start` decides the rest and may still send them away."""
    if environ.get("LOCAL_RANK", "0") != "0":
        return "not local rank 0 (the node's ranks share Triton's cache)", None
    if not _visible_gpu(environ):
        return "no GPU visible", None
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        return "FLA or Triton is not installed", None
    if "-h" in argv or "--help" in argv:
        return "help", None
    try:
        from titan_kimi.config import load_job_config

        cfg = load_job_config(argv, check_registry=False)
    except Exception:  # the trainer reports a bad config itself
        return "the config does not load", None
    if not cfg.kernels.prewarm_fla or cfg.job.dry_run or cfg.compile.prewarm_modules:
        return "kernels.prewarm_fla = false, job.dry_run or compile.prewarm_modules", cfg
    if cfg.kernels.kda not in ("auto", "fla") or cfg.parallelism.context_parallel_degree > 1:
        return "kernels.kda is not fla, or context parallelism", cfg
    return None, cfg


class FlaPrewarm:
    """Starts the prewarm processes (`spawn_early` then `start`, or `start` alone) and reaps them (`finish`: after
    each step until they are done, and at exit)."""

    def __init__(self) -> None:
        self.processes: list[HelperProcess] = []
        self.waiting = False  # spawned early, and not sent the shape yet
        self.launched_at = 0.0
        self._claims: str | None = None

    def _spawn(self, command: list[str], *, stdin: bool) -> None:
        self._claims = tempfile.mkdtemp(prefix="titan_kimi_fla_claims_")
        self.launched_at = time.time()
        self.processes = [HelperProcess(f"fla{i}", [*command, "--claims", self._claims], stdin=stdin)
                          for i in range(PROCESSES)]

    def spawn_early(self, argv: list[str], environ: Mapping[str, str] = os.environ) -> bool:
        """At the top of the entry point, before torch's import: start the processes if the run may use them.
        They import torch and FLA, then wait for `start` to send the shape (or nothing)."""
        reason, cfg = early_unsupported(argv, environ)
        if reason is not None:
            return False
        self._spawn([*_SCRIPT, "--shape-from-stdin", "--fla-configs", cfg.kernels.fla_configs, "--device", "cuda:0"],
                    stdin=True)
        self.waiting = True
        return True

    def start(self, args: KimiK3ModelArgs, cfg: JobConfig, device: torch.device, *, kda_backend: str,
              context_parallel: int, local_rank: int, wanted: bool = True) -> bool:
        """Start when the run can use it (and ``wanted``): the fla backend on a CUDA device, no context parallelism
        (its KDA path differs), KDA layers in the model, one set of processes per node (ranks of a node share
        Triton's cache). Processes spawned early get the shape now, or are sent away."""
        wanted = (wanted and cfg.kernels.prewarm_fla and kda_backend == "fla" and device.type == "cuda"
                  and context_parallel == 1 and local_rank == 0
                  and any(args.is_kda_layer(i) for i in range(args.n_layers)))
        if self.waiting:
            self.waiting = False
            if not wanted:  # stopped at once: what they would still import is wasted on this run
                self.finish(stop=True, quiet=True)
                return False
            shape = shape_arguments(args, cfg)
            cache = os.environ.get("TRITON_CACHE_DIR")  # compile.cache_dir, set after they started
            line = json.dumps(shape + (["--triton-cache-dir", cache] if cache else []))
            for process in self.processes:
                process.send_line(line)
            logger.info("kernels.prewarm_fla: %d processes started at launch compile FLA's KDA kernels (%s)",
                        len(self.processes), " ".join(shape))
            return True
        if not wanted:
            return False
        self._spawn(prewarm_command(args, cfg, device), stdin=False)
        logger.info("kernels.prewarm_fla: compiling FLA's KDA kernels in %d processes (%s)", len(self.processes),
                    ", ".join(str(p.popen.pid) for p in self.processes))
        return True

    def finish(self, *, stop: bool, quiet: bool = False) -> None:
        """Log the outcome once every process has ended; running ones are left alone, or with ``stop`` (at exit)
        stopped."""
        if not self.processes or (not stop and any(p.running() for p in self.processes)):
            return
        quiet = quiet or self.waiting  # never sent the shape (the run failed before): nothing they did to report
        outcomes = [p.finish(timeout_s=0, result_prefix=RESULT_PREFIX) for p in self.processes]
        self.processes, self.waiting = [], False
        if self._claims is not None:
            shutil.rmtree(self._claims, ignore_errors=True)
            self._claims = None
        if not quiet:
            self._log(outcomes)

    def _log(self, outcomes: list[Any]) -> None:
        results = []
        for outcome in outcomes:
            try:
                results.append(json.loads(outcome.line) if outcome.status == "done" else None)
            except ValueError:
                results.append(None)
        if all(isinstance(r, dict) for r in results):
            compiled = sum(r.get("compiled", 0) for r in results)
            logger.info("kernels.prewarm_fla: %d processes compiled %d kernels, done %.1f s after they started (%.1f s "
                        "of it compiling)", len(results), compiled, max(r["done_at"] for r in results) - self.launched_at,
                        max(r["compile_s"] for r in results))
            return
        if (stopped := sum(o.status == "stopped" for o in outcomes)):
            logger.info("kernels.prewarm_fla: %d of %d processes stopped before they finished", stopped, len(outcomes))
        for outcome, result in zip(outcomes, results):
            if outcome.status == "failed":
                logger.warning("kernels.prewarm_fla failed (exit %d; the first step compiled FLA's kernels itself): "
                               "%s", outcome.returncode, outcome.line)
            elif outcome.status == "done" and result is None:
                logger.info("kernels.prewarm_fla: %s", outcome.line)
