"""The shared autotune helpers of lowerings/kernels/launch.py (every kernel's autotuner is built by them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
import triton.language as tl

from lowerings.kernels.launch import config_key, dedup_configs, make_autotuner


@triton.jit
def _noop(X, N, BLOCK: tl.constexpr):
    pass


def test_dedup_keeps_the_first_of_equal_configs_in_order():
    a, b = dict(BLOCK=32, num_warps=4, num_stages=2), dict(BLOCK=64, num_warps=8, num_stages=2)
    assert dedup_configs([a, b, dict(a), dict(num_stages=2, BLOCK=32, num_warps=4)]) == [a, b]


def test_make_autotuner_splits_meta_parameters_from_launch_options():
    cfgs = [dict(BLOCK=32, num_warps=4, num_stages=2), dict(BLOCK=64, num_warps=8, num_stages=3)]
    tuner = make_autotuner(_noop, config_key(cfgs), ["N"], reset_to_zero=["X"])
    assert isinstance(tuner, triton.runtime.Autotuner)
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in tuner.configs] == [
        ({"BLOCK": 32}, 4, 2), ({"BLOCK": 64}, 8, 3)]
    assert list(tuner.keys) == ["N"] and list(tuner.reset_to_zero) == ["X"]
    assert config_key(cfgs) == config_key([dict(reversed(list(c.items()))) for c in cfgs])  # order-free, hashable
    hash(config_key(cfgs))


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path(triton.__file__).parent.joinpath("backends", "nvidia", "bin", "ptxas").exists(),
                    reason="this Triton has no bundled ptxas")
def test_triton_op_kernels_compute_in_fp32_when_given_fp64_scalars(tmp_path):
    # torch.library.wrap_triton types Python floats fp64: without as_fp32 the SiTU-GLU kernels promoted all their
    # math to fp64 (1,216 fp64 PTX lines, 8x slower on the H200 in the inductor mode). Compiled for sm_90a without
    # a GPU, in a subprocess: the CPU tests run under TRITON_INTERPRET=1.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check" / "sm90_kernel_resources.py"), "--scalar-types"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = {s["kernel"]: s for s in map(json.loads, run.stdout.splitlines())}
    assert sorted(stats) == ["attn_res_bwd", "attn_res_fwd", "situ_glu_bwd", "situ_glu_fwd"]
    for name, s in stats.items():
        assert s["fp64_lines"] == 0, (name, s["first"])
