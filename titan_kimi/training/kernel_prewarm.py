"""``kernels.prewarm_fla``: compile FLA's KDA kernels in a background process while the trainer starts.

The process (lowerings/kernels/fla_prewarm.py) runs the op at this run's KDA shape on the same GPU and fills
Triton's on-disk cache; the first step then loads the kernels instead of compiling them one after another. It
shares nothing with training but that cache, so its failure only costs the time it would have saved (logged).
"""

from __future__ import annotations

import logging
import sys

import torch

from titan_kimi.config.sections import JobConfig
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.training.helper_process import HelperProcess

logger = logging.getLogger("titan_kimi")


def prewarm_command(args: KimiK3ModelArgs, cfg: JobConfig, device: torch.device) -> list[str]:
    """The fla_prewarm command line for model ``args`` under ``cfg`` (one KDA call over the packed rows)."""
    t = cfg.training
    dtypes = list(dict.fromkeys([cfg.model.dtype, t.param_dtype]))  # stored, and the compute dtype under FSDP
    command = [sys.executable, "-m", "lowerings.kernels.fla_prewarm",
               "--tokens", str(t.local_batch_size * t.seq_len), "--heads", str(args.kda_num_heads),
               "--head-dim", str(args.kda_head_dim), "--decay-dtypes", *dtypes,
               "--fla-configs", cfg.kernels.fla_configs, "--device", str(device)]
    if args.kda_gate_lower_bound is not None:
        command += ["--lower-bound", repr(float(args.kda_gate_lower_bound))]
    return command


class FlaPrewarm:
    """Starts the prewarm process (`start`) and reaps it (`finish`: after the first step, and at exit)."""

    def __init__(self) -> None:
        self.process: HelperProcess | None = None

    def start(self, args: KimiK3ModelArgs, cfg: JobConfig, device: torch.device, *, kda_backend: str,
              context_parallel: int, local_rank: int) -> bool:
        """Start when the run can use it: the fla backend on a CUDA device, no context parallelism (its KDA path
        differs), KDA layers in the model, one process per node (ranks of a node share Triton's cache)."""
        if not cfg.kernels.prewarm_fla or kda_backend != "fla" or device.type != "cuda" or context_parallel > 1:
            return False
        if local_rank != 0 or not any(args.is_kda_layer(i) for i in range(args.n_layers)):
            return False
        self.process = HelperProcess("fla", prewarm_command(args, cfg, device))
        logger.info("kernels.prewarm_fla: compiling FLA's KDA kernels in process %d", self.process.popen.pid)
        return True

    def finish(self, *, stop: bool) -> None:
        """Log the outcome once the process has ended; a running one is left alone, or with ``stop`` (at exit)
        stopped."""
        if self.process is None or (not stop and self.process.running()):
            return
        outcome = self.process.finish(timeout_s=0)
        self.process = None
        if outcome.status == "done":
            logger.info("kernels.prewarm_fla: %s", outcome.line)
        elif outcome.status == "stopped":
            logger.info("kernels.prewarm_fla: stopped before it finished")
        else:
            logger.warning("kernels.prewarm_fla failed (exit %d; the first step compiled FLA's kernels itself): %s",
                           outcome.returncode, outcome.line)
