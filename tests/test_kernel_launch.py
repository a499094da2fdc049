"""The shared autotune helpers of lowerings/kernels/launch.py (every kernel's autotuner is built by them)."""

from __future__ import annotations

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
