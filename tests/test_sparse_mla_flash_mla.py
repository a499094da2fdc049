"""The FlashMLA sparse-forward glue (lowerings/kernels/flash_mla_sparse.py) and ``kernels.sparse_mla = flash_mla``
on CPU.

FlashMLA itself needs an sm90 GPU, so ``flash_mla.flash_mla_sparse_fwd`` is replaced by a PyTorch stand-in that
follows its documented contract (flash_mla/flash_mla_interface.py, csrc/api/sparse_fwd.h, the sm90 kernel's
asserts): q [s_q, h_q, 576] with h_q 64 or 128, kv [s_kv, 1, 576], indices [s_q, 1, topk] int32 with topk a
positive multiple of 128, -1 or >= s_kv an unused slot, optional topk_length; returns (out, max_logits, lse) with
a natural-log lse and, for a row without a valid key, out 0 and lse +inf. The glue must turn that into our
contract (sparse_mla_reference): any head count, any top-k, lse -inf on empty rows. fp32 inputs, so the
comparison is exact up to summation order. The GPU test (test_sparse_mla_flash_mla_gpu.py) runs the real kernel.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from lowerings.kernels import flash_mla_sparse as fm
from lowerings.ops import configure_backends, op_backends
from lowerings.ops.registry import install_backends, resolved_backends, selected_backend
from lowerings.ops.sparse_mla import backward_kernel, forward_kernel, sparse_mla, sparse_mla_reference

D, DV = 576, 512


def _contract_checks(q, kv, indices, d_v, topk_length):
    s_q, h_q, d_qk = q.shape
    assert h_q in (64, 128), f"FlashMLA sm90 takes 64 or 128 heads, got {h_q}"
    assert d_qk == D and kv.shape[1:] == (1, D) and d_v == DV
    assert indices.dtype == torch.int32 and indices.dim() == 3 and indices.shape[:2] == (s_q, 1)
    topk = indices.shape[2]
    assert topk > 0 and topk % 128 == 0, f"topk must be a positive multiple of 128, got {topk}"
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
    if topk_length is not None:
        assert topk_length.shape == (s_q,) and topk_length.dtype == torch.int32


def make_standin(calls: list, *, empty_garbage: bool = False, with_topk_length: bool = True):
    """A ``flash_mla`` module whose flash_mla_sparse_fwd computes FlashMLA's contract in PyTorch and records its
    calls. ``empty_garbage``: rows without a valid key get NaN out and lse (the glue must not pass them on)."""

    def fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        _contract_checks(q, kv, indices, d_v, topk_length)
        calls.append({"h_q": q.shape[1], "topk": indices.shape[2],
                      "topk_length": None if topk_length is None else topk_length.clone()})
        s_kv, topk = kv.shape[0], indices.shape[2]
        idx = indices[:, 0].long()
        invalid = (idx < 0) | (idx >= s_kv)
        if topk_length is not None:
            invalid |= torch.arange(topk)[None, :] >= topk_length[:, None].long()
        rows = kv[:, 0].double()[idx.clamp(0, max(s_kv - 1, 0))]  # [s_q, topk, D]
        scores = torch.einsum("thd,tkd->thk", q.double(), rows) * sm_scale
        scores = scores.masked_fill(invalid[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        empty = torch.isneginf(lse)
        p = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
        out = torch.einsum("thk,tkd->thd", p, rows[..., :d_v])
        out = out.masked_fill(empty[..., None], float("nan") if empty_garbage else 0.0)
        lse = lse.masked_fill(empty, float("nan") if empty_garbage else float("inf"))
        return out.to(q.dtype), scores.amax(-1).float(), lse.float()

    if not with_topk_length:  # FlashMLA before topk_length existed
        def fwd_old(q, kv, indices, sm_scale, d_v=512, attn_sink=None):
            return fwd(q, kv, indices, sm_scale, d_v, attn_sink)

        fn = fwd_old
    else:
        fn = fwd
    module = types.ModuleType("flash_mla")
    module.flash_mla_sparse_fwd = fn
    return module


@pytest.fixture
def standin(monkeypatch):
    """Install a stand-in ``flash_mla`` (options as make_standin); returns the list of its calls."""

    def install(**kwargs) -> list:
        calls: list = []
        monkeypatch.setitem(sys.modules, "flash_mla", make_standin(calls, **kwargs))
        return calls

    return install


def _inputs(T=24, H=96, k=150, S=40, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=gen) * 0.05).to(dtype)
    kv = torch.randn(S, D, generator=gen).to(dtype)
    idx = torch.randint(0, S, (T, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(T, k, generator=gen) < 0.3] = -1  # scattered unused slots
    if T > 5:
        idx[2] = -1  # an empty row
        idx[5, 3:] = -1  # a -1 suffix
    if T > 7:
        idx[7, :] = -1
        idx[7, k // 2] = 3  # one key mid-row: the extent must reach it
    return q, kv, idx


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_matches_reference(out, lse, q, kv, idx, scale, tol=1e-5):
    ro, rl = sparse_mla_reference(q, kv, idx, scale, DV)
    assert out.shape == ro.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == rl.shape and lse.dtype == torch.float32 and lse.is_contiguous()
    assert rel_err(out, ro) < tol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "empty rows must give lse = -inf, only they"
    fin = torch.isfinite(rl)
    assert torch.isfinite(lse[fin]).all() and (lse[fin] - rl[fin]).abs().max().item() < tol
    empty = (idx < 0).all(1)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


# ---------------------------------------------------------------------------------------------- head windows


@pytest.mark.parametrize("H, expected", [
    (16, ((0, 64, 0, 16),)),
    (64, ((0, 64, 0, 64),)),
    (96, ((0, 64, 0, 64), (32, 64, 32, 64))),
    (128, ((0, 128, 0, 128),)),
    (192, ((0, 128, 0, 128), (128, 64, 0, 64))),
    (200, ((0, 128, 0, 128), (128, 64, 0, 64), (136, 64, 56, 64))),
])
def test_head_windows(H, expected):
    assert fm.head_windows(H) == expected


def test_head_windows_cover_every_head_once():
    for H in range(1, 400):
        kept = []
        for start, width, lo, hi in fm.head_windows(H):
            assert width in fm.SUPPORTED_HEADS and 0 <= lo < hi <= width
            assert start >= 0 and (start + width <= H or (start == 0 and H < 64))
            kept += range(start + lo, start + hi)
        assert kept == list(range(H)), H
    with pytest.raises(ValueError, match="H must be positive, got 0"):
        fm.head_windows(0)


# ---------------------------------------------------------------------------------------------- the glue


@pytest.mark.parametrize("H", [16, 64, 96, 128, 200])
@pytest.mark.parametrize("k", [20, 128, 150])
def test_forward_matches_reference(standin, H, k):
    calls = standin()
    q, kv, idx = _inputs(H=H, k=k, seed=H + k)
    out, lse = fm.flash_mla_sparse_forward(q, kv, idx, 0.07, DV)
    assert_matches_reference(out, lse, q, kv, idx, 0.07)
    assert len(calls) == len(fm.head_windows(H))
    ext = torch.where(idx >= 0, torch.arange(1, k + 1, dtype=torch.int32), 0).amax(1)
    for call in calls:
        assert call["topk"] == -(-k // 128) * 128  # -1 padded to the kernel's multiple
        assert torch.equal(call["topk_length"], ext)  # -1 suffixes skipped, mid-row keys kept
    assert ext[7] == k // 2 + 1 and ext[2] == 0


def test_forward_bf16_matches_reference(standin):
    standin()
    q, kv, idx = _inputs(H=96, k=256, dtype=torch.bfloat16, seed=3)
    out, lse = fm.flash_mla_sparse_forward(q, kv, idx, 0.07, DV)
    ro, rl = sparse_mla_reference(q, kv, idx, 0.07, DV)
    assert out.dtype == torch.bfloat16 and rel_err(out, ro) < 1e-2
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isneginf(lse), ~fin) and (lse[fin] - rl[fin]).abs().max() < 1e-4


def test_out_of_range_indices_count_as_unused(standin):
    standin()
    q, kv, idx = _inputs(H=64, k=40, S=40, seed=5)
    far = idx.clone()
    far[idx < 0] = 40 + 7  # >= S: unused, like -1
    out, lse = fm.flash_mla_sparse_forward(q, kv, far, 0.07, DV)
    assert_matches_reference(out, lse, q, kv, idx, 0.07)


def test_empty_rows_forced_whatever_the_kernel_returns(standin):
    """FlashMLA gives lse +inf on empty rows (and its out there is only 0 by construction): ours is -inf and 0."""
    standin(empty_garbage=True)
    for H in (64, 96, 16):
        q, kv, idx = _inputs(H=H, k=130, seed=H)
        out, lse = fm.flash_mla_sparse_forward(q, kv, idx, 0.07, DV)
        assert not out.isnan().any() and not lse.isnan().any()
        assert_matches_reference(out, lse, q, kv, idx, 0.07)


def test_lse_is_natural_log(standin):
    """One key per row: lse is exactly the scaled score (natural log, not log2)."""
    standin()
    q, kv, _ = _inputs(T=6, H=64, S=10, seed=7)
    idx = torch.full((6, 5), -1, dtype=torch.int32)
    idx[:, 2] = torch.arange(6, dtype=torch.int32)
    out, lse = fm.flash_mla_sparse_forward(q, kv, idx, 0.3, DV)
    score = 0.3 * torch.einsum("thd,td->th", q.double(), kv[:6].double())
    assert (lse.double() - score).abs().max() < 1e-5
    assert rel_err(out, kv[:6, None, :DV].expand(6, 64, DV)) < 1e-6


def test_nothing_to_attend_skips_the_kernel(standin):
    calls = standin()
    q, kv, _ = _inputs(T=5, H=96)
    for idx, kv_ in ((torch.empty(5, 0, dtype=torch.int32), kv), (torch.full((5, 3), -1, dtype=torch.int32), kv[:0])):
        out, lse = fm.flash_mla_sparse_forward(q, kv_, idx, 0.1, DV)
        assert out.shape == (5, 96, DV) and (out == 0).all() and torch.isneginf(lse).all()
    out, lse = fm.flash_mla_sparse_forward(q[:0], kv, torch.zeros(0, 4, dtype=torch.int32), 0.1, DV)
    assert out.shape == (0, 96, DV) and lse.shape == (0, 96)
    assert calls == []


def test_flash_mla_without_topk_length(standin):
    """A FlashMLA whose flash_mla_sparse_fwd has no topk_length: the -1 padding alone masks the slots."""
    calls = standin(with_topk_length=False)
    q, kv, idx = _inputs(H=96, k=150, seed=11)
    out, lse = fm.flash_mla_sparse_forward(q, kv, idx, 0.07, DV)
    assert_matches_reference(out, lse, q, kv, idx, 0.07)
    assert all(c["topk_length"] is None for c in calls)


def test_forward_rejects_bad_inputs(standin):
    standin()
    q, kv, idx = _inputs(H=64, k=16)
    with pytest.raises(ValueError, match="Dqk = 576, got q 100"):
        fm.flash_mla_sparse_forward(q[..., :100], kv[:, :100], idx, 0.1, 64)
    with pytest.raises(ValueError, match="d_v = 512, got 256"):
        fm.flash_mla_sparse_forward(q, kv, idx, 0.1, 256)
    with pytest.raises(ValueError, match="int32 indices, got torch.int64"):
        fm.flash_mla_sparse_forward(q, kv, idx.long(), 0.1, DV)
    with pytest.raises(ValueError, match=r"idx \[T,k\]; got .*\(23, 16\)"):
        fm.flash_mla_sparse_forward(q, kv, idx[1:], 0.1, DV)


# ---------------------------------------------------------------------------------------------- routing


def test_flash_mla_takes():
    q, kv, idx = _inputs(H=96, k=2048, dtype=torch.bfloat16)
    assert fm.flash_mla_takes(q, kv, idx, DV) is None
    assert fm.flash_mla_takes(q[:, :16], kv, idx[:, :5], DV) is None  # any head count, any top-k
    assert "bf16 q and kv, got torch.float32" in fm.flash_mla_takes(q.float(), kv.float(), idx, DV)
    assert "d_v = 512, got 256" in fm.flash_mla_takes(q, kv, idx, 256)
    assert "Dqk = 576, got q 192" in fm.flash_mla_takes(q[..., :192], kv[:, :192], idx, DV)
    big = torch.empty(2**21, 1, D, dtype=torch.bfloat16, device="meta")
    assert "int32 offsets" in fm.flash_mla_takes(big, kv, torch.empty(2**21, 2048, dtype=torch.int32, device="meta"),
                                                 DV)


def test_forward_kernel_routing():
    q, kv, idx = _inputs(H=96, k=64, dtype=torch.bfloat16)
    assert forward_kernel("flash_mla", q, kv, idx, DV, cuda=True) == "flash_mla"
    assert forward_kernel("flash_mla", q.float(), kv.float(), idx, DV, cuda=True) == "triton"  # fp32: ours
    assert forward_kernel("flash_mla", q[..., :192], kv[:, :192], idx, 128, cuda=True) == "triton"
    assert forward_kernel("flash_mla", q, kv, idx, DV) == "reference"  # CPU tensors
    assert forward_kernel("triton", q, kv, idx, DV, cuda=True) == "triton"
    assert forward_kernel("dense", q, kv, idx, DV) == "dense"
    assert forward_kernel("cudnn", q, kv, idx, DV, cuda=True) == "triton"  # cuDNN has no sm90 sparse forward


def test_backward_kernel_routing():
    q, kv, idx = _inputs(H=96, k=64, dtype=torch.bfloat16)
    assert backward_kernel("flash_mla", q, kv, idx, DV, cuda=True) == "triton"  # FlashMLA has no sparse backward
    assert backward_kernel("cudnn", q, kv, idx, DV) == "reference"  # CPU tensors
    assert backward_kernel("cudnn", q, kv, idx, DV, cuda=True) == "triton"  # cuDNN's own check: CPU tensors
    assert backward_kernel("triton", q, kv, idx, DV, cuda=True) == "triton"
    assert backward_kernel("dense", q, kv, idx, DV, cuda=True) == "dense"
    assert backward_kernel("reference", q, kv, idx, DV, cuda=True) == "reference"


@pytest.fixture
def sparse_mla_backend():
    """The sparse_mla backends; the resolved choice is restored after the test."""
    saved = resolved_backends()
    yield op_backends("sparse_mla")
    install_backends(saved)


def test_op_with_flash_mla_selected_on_cpu_runs_the_reference(sparse_mla_backend):
    """CPU tensors take the reference forward and backward under kernels.sparse_mla = flash_mla, as under triton."""
    install_backends(resolved_backends().replaced({"sparse_mla": "flash_mla"}))  # as on a machine with flash_mla
    q, kv, idx = _inputs(T=10, H=4, k=12, S=10, seed=2)
    q.requires_grad_()
    kv.requires_grad_()
    out, lse = sparse_mla(q, kv, idx, scale=0.1, d_v=DV)
    ro, rl = sparse_mla_reference(q, kv, idx, 0.1, DV)
    assert torch.equal(out, ro) and torch.equal(lse, rl)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    rdq, rdkv = torch.autograd.grad(ro, (q, kv), dout)
    assert rel_err(dq, rdq) < 1e-6 and rel_err(dkv, rdkv) < 1e-6


# ---------------------------------------------------------------------------------------------- registry


def _pretend_sm90(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_selecting_flash_mla_without_cuda_fails_with_the_reason(sparse_mla_backend):
    before = selected_backend("sparse_mla")
    with pytest.raises(ValueError, match=r"kernels.sparse_mla = 'flash_mla' is not available .*no CUDA device"):
        configure_backends({"sparse_mla": "flash_mla"})
    assert selected_backend("sparse_mla") == before


def test_selecting_flash_mla_without_the_module_fails_with_the_reason(monkeypatch, sparse_mla_backend):
    _pretend_sm90(monkeypatch)
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla raises ModuleNotFoundError
    before = selected_backend("sparse_mla")
    with pytest.raises(ValueError, match=r"python module 'flash_mla' is not installed \(build it with "
                                         r"scripts/tools/build_flash_mla.sh"):
        configure_backends({"sparse_mla": "flash_mla"})
    assert selected_backend("sparse_mla") == before


def test_flash_mla_unavailable_reasons(monkeypatch):
    _pretend_sm90(monkeypatch, capability=(10, 0))
    assert "sm90 only; this GPU (Pretend GPU) has compute capability 10.0" in fm.unavailable_reason()
    _pretend_sm90(monkeypatch)
    monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
    assert "has no flash_mla_sparse_fwd" in fm.unavailable_reason()
    real_import = fm.importlib.import_module

    def import_module(name, package=None):  # flash_mla's extension built against another torch
        if name == "flash_mla":
            raise ImportError("undefined symbol: _ZN3c10")
        return real_import(name, package)

    monkeypatch.delitem(sys.modules, "flash_mla")
    monkeypatch.setattr(fm.importlib, "import_module", import_module)
    assert "does not import: ImportError: undefined symbol" in fm.unavailable_reason()


def test_selecting_flash_mla_with_the_module(monkeypatch, sparse_mla_backend, standin):
    _pretend_sm90(monkeypatch)
    standin()
    assert configure_backends({"sparse_mla": "flash_mla"}) == {"sparse_mla": "flash_mla"}
    assert selected_backend("sparse_mla") == "flash_mla"
    # auto: cuDNN's backward first (the faster pair on the H200), then FlashMLA's forward, then ours
    assert sparse_mla_backend.auto_order == ["cudnn", "flash_mla", "triton"]
