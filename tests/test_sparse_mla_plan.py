"""The sparse-MLA forward's head split (`fwd_plan`): launches over head ranges [h0, h1) must write exactly
their heads, so a split run equals the one-launch run and the float64 reference (CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.test_triton_kernels import (  # noqa: F401 - fixtures are registered by import
    DV,
    _interp_mods,
    _sparse_inputs,
    assert_lse_close,
    ik,
    ref_sparse_mla,
    rel_err,
)


def test_plan_on_gpu_splits_whole_64_head_blocks(ik):
    F = ik.sparse_mla_fwd
    assert F.fwd_plan(96) == [(0, 64, F.HEADS_MAJOR_64), (64, 96, None)]
    assert F.fwd_plan(128) == [(0, 128, F.HEADS_MAJOR_64)]
    assert F.fwd_plan(32) == [(0, 32, None)]
    assert F.fwd_plan(96, on_gpu=False) == [(0, 96, None)]
    assert F.HEADS_MAJOR_64 in F.fwd_configs(96)


@pytest.mark.parametrize("split", [1, 2])
def test_split_launches_match_reference(ik, monkeypatch, split):
    F = ik.sparse_mla_fwd
    q, kv, idx = _sparse_inputs(T=20, H=5, k=24, seed=3)
    heads_major = dict(BLOCK_H=16, BLOCK_N=16, KEYS_MAJOR=False, num_warps=4, num_stages=1)
    # heads [0, split) heads-major, [split, 5) on the default (keys-major) config: both code paths, offset h0
    monkeypatch.setattr(F, "fwd_plan", lambda H, on_gpu=True: [(0, split, heads_major), (split, H, None)])
    out, lse = F.sparse_mla_forward(q, kv, idx, 0.125, DV)
    ro, rl = ref_sparse_mla(q, kv, idx, 0.125, DV, torch.float64)
    assert rel_err(out, ro) < 1e-5
    assert_lse_close(lse, rl, 1e-5)
    one, one_lse = F.sparse_mla_forward(q, kv, idx, 0.125, DV, config=F.default_fwd_config(5, on_gpu=False))
    assert rel_err(out, one) < 1e-6 and rel_err(lse[torch.isfinite(lse)], one_lse[torch.isfinite(one_lse)]) < 1e-6


def test_dkv_head_split(ik):
    B = ik.sparse_mla_bwd
    assert [B.head_split(h) for h in (3, 16, 24, 40, 64, 96, 128)] == [
        (16, 0), (16, 0), (16, 16), (32, 16), (64, 0), (64, 32), (128, 0)]


@pytest.mark.parametrize("H", [24, 40])
def test_backward_with_split_heads_and_separate_rope_columns(ik, H):
    """dKV with the heads as two MMA K parts (16+16, 32+16) and the rope columns in their own launch."""
    from tests.test_triton_kernels import ref_sparse_mla_grads

    q, kv, idx = _sparse_inputs(T=12, H=H, k=10, seed=4)
    dout = torch.randn(12, H, DV, generator=torch.Generator().manual_seed(5))
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV)
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV)
    _, _, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.125, DV, dout)
    assert rel_err(dq, rdq) < 1e-5
    assert rel_err(dkv[:, :DV], rdkv[:, :DV]) < 1e-5 and rel_err(dkv[:, DV:], rdkv[:, DV:]) < 1e-5
