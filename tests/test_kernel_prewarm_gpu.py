"""GPU: lowerings/kernels/fla_prewarm.py fills Triton's cache with every kernel the fla KDA op needs at a shape."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--tokens", "1024", "--heads", "4", "--head-dim", "128", "--lower-bound", "-5.0"]


def kernel_dirs(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_second_process_at_the_prewarmed_shape_compiles_nothing_new(tmp_path):
    cache = tmp_path / "triton"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = lambda *args: subprocess.run([sys.executable, "-m", "lowerings.kernels.fla_prewarm", *SHAPE, *args],
                                       env=env, capture_output=True, text=True, timeout=600)
    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 forward + backward calls" in first.stdout
    compiled = kernel_dirs(cache)
    assert len(compiled) >= 10  # FLA's forward and backward kernels, l2norm and the gate included
    second = run()
    assert second.returncode == 0, second.stdout + second.stderr
    assert kernel_dirs(cache) == compiled  # every kernel came from the cache
