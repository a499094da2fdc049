"""Entry point: ``torchrun --nproc-per-node=N -m titan_kimi.train --job.config_file train_configs/<recipe>.toml``.

A launcher: it starts FLA's prewarm processes before torch's import (13-15 s on a GPU node), so that they have
FLA's kernels compiled by the first step, then imports the trainer (titan_kimi/trainer.py) and runs it.
"""

from __future__ import annotations

import sys
from typing import Sequence


def launch(argv: Sequence[str] | None = None) -> int:
    """Run the trainer on ``argv`` (the command line's by default); the exit status (`run_cli`)."""
    from titan_kimi.compile.kernel_prewarm import FlaPrewarm  # imports no torch

    argv = list(sys.argv[1:] if argv is None else argv)
    prewarm = FlaPrewarm()
    prewarm.spawn_early(argv)  # they import torch and FLA while this process does the same below
    from titan_kimi.trainer import main
    from titan_kimi.training.process.exit_codes import run_cli

    return run_cli(lambda args: main(args, prewarm=prewarm), argv)


if __name__ == "__main__":
    sys.exit(launch())
