"""Triton kernels in lowerings/kernels/ against pure-PyTorch references.

CPU: the kernels run under the Triton interpreter (TRITON_INTERPRET=1) at tiny shapes. The interpreter is
chosen when @triton.jit runs, so the kernel modules are imported a second time, under a private package
name, with the variable set (the normal `lowerings.kernels.*` modules stay compiled-mode for the GPU tests).
Autotuning is bypassed for CPU tensors by the entry points themselves.

GPU (@pytest.mark.gpu, skipped without CUDA): realistic K3 shapes in bf16 against the same references.
    python -m pytest -m gpu tests/test_triton_kernels.py
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

KERNELS_DIR = Path(__file__).resolve().parents[1] / "lowerings" / "kernels"
KERNEL_MODULES = ("sparse_mla_fwd", "sparse_mla_bwd", "indexer_topk", "situ_glu", "attn_res_mix", "indexer_kl",
                  "routed_combine", "short_conv")
_INTERP_PKG = "_titan_kimi_interpreted_kernels"

# ----------------------------------------------------------------------------------------------------------
# pure-PyTorch references (also imported by scripts/bench/fused_ops.py)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def ref_sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int,
                   compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, d_v], lse [T, H] (natural log; empty rows: out 0, lse -inf), by gathering kv rows.
    GEMMs run in compute_dtype (default q's dtype), softmax in at least fp32. Differentiable."""
    cd = compute_dtype or q.dtype
    acc = _acc_dtype(cd)
    valid = (idx >= 0) & (idx < kv.shape[0])
    g = kv.to(cd)[idx.long().clamp(0, kv.shape[0] - 1)]  # [T, k, D]
    s = torch.einsum("thd,tkd->thk", q.to(cd), g).to(acc) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).masked_fill(~valid[:, None, :], 0.0)
    out = torch.einsum("thk,tkd->thd", p.to(cd), g[..., :d_v])
    return out, lse.float()


def ref_sparse_mla_grads(q, kv, idx, scale, d_v, dout, chunk: int | None = None,
                         compute_dtype: torch.dtype = torch.float64):
    """(out, lse, dq, dkv) by autograd through ref_sparse_mla, optionally in token chunks (GPU memory)."""
    T = q.shape[0]
    chunk = chunk or max(T, 1)
    kvr = kv.detach().to(compute_dtype).requires_grad_()
    outs, lses, dqs = [], [], []
    for t0 in range(0, T, chunk):
        qc = q[t0:t0 + chunk].detach().to(compute_dtype).requires_grad_()
        o, l = ref_sparse_mla(qc, kvr, idx[t0:t0 + chunk], scale, d_v, compute_dtype)
        o.backward(dout[t0:t0 + chunk].to(o.dtype))
        outs.append(o.detach())
        lses.append(l.detach())
        dqs.append(qc.grad)
    return torch.cat(outs), torch.cat(lses), torch.cat(dqs), kvr.grad


def ref_indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seg_start: torch.Tensor, scale: float,
                       compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense masked scores [T, T]: sum_h w relu(scale q.k), -inf outside [seg_start[t], t]. Head by head."""
    T, HI, _ = q.shape
    kc = k.to(compute_dtype)
    s = torch.zeros(T, T, dtype=compute_dtype, device=q.device)
    for h in range(HI):
        s += w[:, h, None].to(compute_dtype) * torch.relu(scale * (q[:, h].to(compute_dtype) @ kc.T))
    ar = torch.arange(T, device=q.device)
    valid = (ar[None, :] >= seg_start[:, None].long()) & (ar[None, :] <= ar[:, None])
    return s.masked_fill(~valid, float("-inf"))


def ref_indexer_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of dense masked scores, ties to the most recent key, ascending key order, -1 suffix."""
    T = scores.shape[0]
    vals, order = torch.sort(scores.flip(-1), dim=1, descending=True, stable=True)  # stable on flipped: recent first
    vals, sel = vals[:, : min(topk, T)], T - 1 - order[:, : min(topk, T)]
    sel = torch.where(torch.isneginf(vals), T, sel).sort(dim=1).values
    return torch.where(sel == T, -1, sel).to(torch.int32)


def ref_situ_glu(gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))


def ref_attn_res_mix(bank: torch.Tensor, partial: torch.Tensor, g: torch.Tensor, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
    v = torch.cat([bank, partial[:, None]], dim=1)
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    z = (v * r * (g * w)).sum(-1)
    a = torch.softmax(z, dim=-1)
    return (a[..., None] * v).sum(1)


# ----------------------------------------------------------------------------------------------------------
# helpers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "empty-row pattern of lse differs"
    fin = torch.isfinite(ref)
    assert torch.isfinite(lse[fin]).all()
    assert (lse[fin].double() - ref[fin].double()).abs().max().item() <= atol


def assert_topk_valid(idx: torch.Tensor, scores: torch.Tensor, topk: int, tol: float) -> None:
    """idx is a correct top-k of `scores` up to (near-)ties: well formed (ascending, no duplicates, -1 suffix,
    inside each row's window), the right number of keys, and the chosen scores equal the top-k scores."""
    T = scores.shape[0]
    kk = min(topk, T)
    assert idx.shape == (T, kk) and idx.dtype == torch.int32
    idx = idx.long()
    used = idx >= 0
    n_used = used.sum(1)
    assert torch.equal(used, torch.arange(kk, device=idx.device)[None, :] < n_used[:, None]), "-1 must be a suffix"
    nxt = idx[:, 1:]
    assert ((nxt > idx[:, :-1]) | ~used[:, 1:]).all(), "indices must be strictly ascending (no duplicates)"
    n_valid = torch.isfinite(scores).sum(1)
    assert torch.equal(n_used, n_valid.clamp(max=kk)), "rows must return min(k, #valid) keys"
    chosen = torch.where(used, scores.gather(1, idx.clamp(min=0)), torch.full_like(scores[:, :1], float("-inf")))
    assert torch.isfinite(chosen[used]).all(), "an index outside its row's [seg_start, t] window"
    got = chosen.sort(dim=1, descending=True).values
    want = scores.topk(kk, dim=1).values
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[fin] - want[fin]).abs().max().item() <= tol if fin.any() else True


def causal_topk_indices(T: int, k: int, seg_start: torch.Tensor, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random document-local causal selections, like the indexer emits: ascending, -1 suffix."""
    scores = torch.rand(T, T, generator=gen).to(device)
    ar = torch.arange(T, device=device)
    valid = (ar[None, :] >= seg_start[:, None].long()) & (ar[None, :] <= ar[:, None])
    return ref_indexer_topk(scores.masked_fill(~valid, float("-inf")), k)


def doc_seg_start(T: int, bounds: list[int], device="cpu") -> torch.Tensor:
    """seg_start [T] int32 for documents starting at each position in `bounds` (0 implied)."""
    seg = torch.zeros(T, dtype=torch.int32, device=device)
    for b in sorted(bounds):
        seg[b:] = b
    return seg


# ----------------------------------------------------------------------------------------------------------
# interpreter fixtures


def _load_interpreted() -> types.SimpleNamespace:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if _INTERP_PKG not in sys.modules:
            pkg = types.ModuleType(_INTERP_PKG)
            pkg.__path__ = [str(KERNELS_DIR)]  # relative imports between kernel files resolve here
            sys.modules[_INTERP_PKG] = pkg
        mods = {name: importlib.import_module(f"{_INTERP_PKG}.{name}") for name in KERNEL_MODULES}
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return types.SimpleNamespace(**mods)


@pytest.fixture(scope="module")
def _interp_mods() -> types.SimpleNamespace:
    return _load_interpreted()


@pytest.fixture
def ik(_interp_mods, monkeypatch) -> types.SimpleNamespace:
    """Interpreted kernel modules; TRITON_INTERPRET=1 while the test runs (entry points read it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _interp_mods


# ----------------------------------------------------------------------------------------------------------
# sparse MLA (CPU interpreter)

DV, DR = 32, 16  # scaled-down 512 / 64


def _sparse_inputs(T=24, H=3, k=20, S=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = S or T
    q = torch.randn(T, H, DV + DR, generator=gen).to(dtype)
    kv = torch.randn(S, DV + DR, generator=gen).to(dtype)
    idx = torch.randint(0, S, (T, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(T, k, generator=gen) < 0.3] = -1  # scattered unused slots
    idx[2] = -1  # empty row
    idx[5, 3:] = -1  # -1 suffix
    idx[6, :] = idx[6, 0]  # the same key repeated (counted once per slot, like the reference)
    return q, kv, idx


@pytest.mark.parametrize("keys_major", [True, False])
def test_sparse_mla_fwd_fp32(ik, keys_major):
    q, kv, idx = _sparse_inputs()
    cfg = dict(BLOCK_H=16, BLOCK_N=16, KEYS_MAJOR=keys_major, num_warps=4, num_stages=1)
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV, config=cfg)
    ro, rl = ref_sparse_mla(q, kv, idx, 0.125, DV, torch.float64)
    assert out.shape == (24, 3, DV) and out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ro) < 1e-5
    assert_lse_close(lse, rl, 1e-5)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


def test_sparse_mla_bwd_fp32(ik):
    q, kv, idx = _sparse_inputs(seed=1)
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(24, 3, DV, generator=gen)
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV)
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV)
    _, _, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.125, DV, dout)
    assert dq.shape == q.shape and dkv.shape == kv.shape
    assert rel_err(dq, rdq) < 1e-5 and rel_err(dkv, rdkv) < 1e-5
    assert (dq[2] == 0).all()  # empty row


def test_sparse_mla_bwd_workspace_chunks(ik):
    """A small workspace cap splits the backward into token chunks (P/dS workspace reused)."""
    q, kv, idx = _sparse_inputs(seed=4)
    dout = torch.randn(24, 3, DV, generator=torch.Generator().manual_seed(5))
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV)
    per_token = 2 * idx.shape[1] * q.shape[1] * 4
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV, workspace_bytes=5 * per_token)
    _, _, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.125, DV, dout)
    assert rel_err(dq, rdq) < 1e-5 and rel_err(dkv, rdkv) < 1e-5


@pytest.mark.parametrize("H, bh, chunks", [(3, 16, 1), (20, 16, 1), (20, 16, 3)])
def test_sparse_mla_bwd_head_mass(ik, H, bh, chunks):
    """``head_mass``: sum_h P per slot (0 at -1 slots and in the empty row), from one head block or the atomic
    adds of several (20 heads in blocks of 16), in one or several workspace chunks; dq, dkv unchanged."""
    q, kv, idx = _sparse_inputs(H=H, seed=7)
    dout = torch.randn(24, H, DV, generator=torch.Generator().manual_seed(8))
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV)
    per_token = 2 * idx.shape[1] * H * 4
    kw = dict(workspace_bytes=(24 // chunks + 1) * per_token, dq_config=dict(BLOCK_H=bh, BLOCK_N=16, num_warps=4,
                                                                              num_stages=1))
    dq, dkv, mass = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV, head_mass=True, **kw)
    dq0, dkv0 = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV, **kw)
    valid = idx >= 0
    g = kv.double()[idx.long().clamp(min=0)]
    s = torch.einsum("thd,tkd->thk", q.double(), g) * 0.125
    p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), -1).nan_to_num(0.0)
    assert mass.shape == idx.shape and mass.dtype == torch.float32
    assert rel_err(mass, p.sum(1)) < 1e-5
    assert (mass[~valid] == 0).all() and (mass[2] == 0).all()
    assert torch.equal(dq, dq0) and rel_err(dkv, dkv0) < 1e-6


def test_sparse_mla_bf16_causal_docs(ik):
    """bf16 end to end with indexer-style indices: causal, document-local, ascending, -1 suffix."""
    T, H, k = 32, 4, 12
    gen = torch.Generator().manual_seed(3)
    seg = doc_seg_start(T, [9, 20])
    idx = causal_topk_indices(T, k, seg, gen)
    q = torch.randn(T, H, DV + DR, generator=gen).bfloat16()
    kv = torch.randn(T, DV + DR, generator=gen).bfloat16()
    dout = torch.randn(T, H, DV, generator=gen).bfloat16()
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.2, DV)
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.2, DV)
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.2, DV, dout)
    assert out.dtype == dq.dtype == dkv.dtype == torch.bfloat16
    assert rel_err(out, ro) < 1e-2 and rel_err(dq, rdq) < 1e-2 and rel_err(dkv, rdkv) < 1e-2
    assert_lse_close(lse, rl, 1e-2)


@pytest.mark.parametrize("H,d_v,d_r", [(1, 32, 16), (20, 16, 0), (5, 24, 8)])
def test_sparse_mla_shapes(ik, H, d_v, d_r):
    """Masked head blocks (H=20 -> 16 + 4), no rope tail, non-power-of-two value width, S_kv != T."""
    T, S, k = 10, 14, 9
    gen = torch.Generator().manual_seed(H)
    q = torch.randn(T, H, d_v + d_r, generator=gen)
    kv = torch.randn(S, d_v + d_r, generator=gen)
    idx = torch.randint(-1, S, (T, k), generator=gen, dtype=torch.int32)
    dout = torch.randn(T, H, d_v, generator=gen)
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.3, d_v)
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.3, d_v)
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.3, d_v, dout)
    assert rel_err(out, ro) < 1e-5 and rel_err(dq, rdq) < 1e-5 and rel_err(dkv, rdkv) < 1e-5
    assert_lse_close(lse, rl, 1e-5)


@pytest.mark.parametrize("fwd_cfg,dq_cfg,dkv_cfg", [
    (dict(BLOCK_H=32, BLOCK_N=32, KEYS_MAJOR=True, num_warps=4, num_stages=1),
     dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=1), dict(BLOCK_N=32, BLOCK_D=64, num_warps=4, num_stages=1)),
    (dict(BLOCK_H=16, BLOCK_N=64, KEYS_MAJOR=False, num_warps=4, num_stages=1),
     dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=1), dict(BLOCK_N=64, BLOCK_D=16, num_warps=4, num_stages=1)),
])
def test_sparse_mla_other_tilings(ik, fwd_cfg, dq_cfg, dkv_cfg):
    """Tile sizes that do not divide k (20) or the head count, and more column blocks than Dqk needs."""
    q, kv, idx = _sparse_inputs(seed=7)
    dout = torch.randn(24, 3, DV, generator=torch.Generator().manual_seed(8))
    out, lse = ik.sparse_mla_fwd.sparse_mla_forward(q, kv, idx, 0.125, DV, config=fwd_cfg)
    dq, dkv = ik.sparse_mla_bwd.sparse_mla_backward(dout, q, kv, idx, out, lse, 0.125, DV,
                                                    dq_config=dq_cfg, dkv_config=dkv_cfg)
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, 0.125, DV, dout)
    assert rel_err(out, ro) < 1e-5 and rel_err(dq, rdq) < 1e-5 and rel_err(dkv, rdkv) < 1e-5
    assert_lse_close(lse, rl, 1e-5)


def test_sparse_mla_rejects_bad_inputs(ik):
    q, kv, idx = _sparse_inputs(T=8, k=4)
    f = ik.sparse_mla_fwd.sparse_mla_forward
    with pytest.raises(ValueError, match="int32"):
        f(q, kv, idx.long(), 0.1, DV)
    with pytest.raises(ValueError, match="Dqk"):
        f(q, kv[:, :-1], idx, 0.1, DV)
    with pytest.raises(ValueError, match="idx"):
        f(q, kv, idx[:3], 0.1, DV)
    with pytest.raises(ValueError, match="d_v"):
        f(q, kv, idx, 0.1, DV + DR + 1)
    with pytest.raises(ValueError, match="dtype"):
        f(q.bfloat16(), kv, idx, 0.1, DV)


# ----------------------------------------------------------------------------------------------------------
# indexer top-k (CPU interpreter)


def _indexer_inputs(T=40, HI=4, D=16, w_dtype=torch.float32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HI, D, generator=gen).to(dtype)
    k = torch.randn(T, D, generator=gen).to(dtype)
    w = (torch.randn(T, HI, generator=gen) * HI ** -0.5).to(w_dtype)
    return q, k, w


@pytest.mark.parametrize("select", ["threshold", "sort_keys"])
@pytest.mark.parametrize("cap_rows", [None, 7])
def test_indexer_topk_docs_and_chunks(ik, cap_rows, select):
    """Several documents; one chunk, or 7-row chunks (the cap forces 6 chunks of growing width)."""
    T, topk = 40, 8
    q, k, w = _indexer_inputs(T)
    seg = doc_seg_start(T, [11, 12, 30])  # includes a one-token document
    cap = (1 << 30) if cap_rows is None else 4 * T * cap_rows
    idx = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, 0.5, mem_cap_bytes=cap, select=select)
    scores = ref_indexer_scores(q, k, w, seg, 0.5)
    assert_topk_valid(idx, scores, topk, tol=1e-5)
    assert torch.equal(idx, ref_indexer_topk(scores, topk))  # no near-ties at this seed
    assert (idx[11] == torch.tensor([11] + [-1] * 7, dtype=torch.int32)).all()  # one-token document
    assert (idx[0, 1:] == -1).all() and idx[0, 0] == 0


@pytest.mark.parametrize("select", ["threshold", "sort_keys"])
def test_indexer_topk_ties_go_to_most_recent(ik, select):
    """Exact ties (ReLU zeros, signed zeros) pick the most recent keys, as docs/ops.md requires."""
    T, topk = 40, 6
    q, k, w = _indexer_inputs(T, seed=6)
    q[:20] = 0.0  # rows 0..19: every in-window score is exactly 0 (+0.0 or -0.0 by w's sign)
    q[20:] = -q[20:].abs()
    k[:] = k.abs()  # rows 20..39: q.k <= 0, so scores are 0 except where a few keys are made positive
    k[25] = -k[25]
    k[31] = -k[31]
    seg = doc_seg_start(T, [8, 30])
    idx = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, 0.5, select=select)
    scores = ref_indexer_scores(q, k, w, seg, 0.5, torch.float32)
    assert torch.equal(idx, ref_indexer_topk(scores, topk))
    ar = torch.arange(T)
    for t in range(20):  # all-zero rows: the last min(topk, window) keys
        want = ar[max(int(seg[t]), t - topk + 1): t + 1]
        assert torch.equal(idx[t, : len(want)].long(), want)


def test_indexer_topk_k_larger_than_T(ik):
    """topk > T: output is [T, T] and every row returns all its valid keys."""
    T = 12
    q, k, w = _indexer_inputs(T, seed=1)
    seg = doc_seg_start(T, [5])
    idx = ik.indexer_topk.indexer_topk(q, k, w, seg, 64, 0.3)
    assert idx.shape == (T, T)
    ar = torch.arange(T)
    for t in range(T):
        want = ar[seg[t]: t + 1]
        assert torch.equal(idx[t, : len(want)].long(), want) and (idx[t, len(want):] == -1).all()


def test_indexer_topk_bf16_weights_and_inputs(ik):
    T, topk = 32, 6
    q, k, w = _indexer_inputs(T, HI=3, D=20, w_dtype=torch.bfloat16, dtype=torch.bfloat16, seed=2)
    seg = doc_seg_start(T, [16])
    idx = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, 0.25, mem_cap_bytes=4 * T * 10)
    scores = ref_indexer_scores(q, k, w, seg, 0.25)  # exact products of the bf16 values
    assert_topk_valid(idx, scores, topk, tol=1e-4)


def test_indexer_scores_match_dense(ik):
    """The chunk score buffer itself, including -inf outside the window and skipped tiles."""
    T = 40
    q, k, w = _indexer_inputs(T, seed=3)
    seg = doc_seg_start(T, [25])
    buf = torch.full((15, T), 7.0)
    ik.indexer_topk.indexer_scores(q, k, w, seg, 0.5, 20, 15, buf)
    ref = ref_indexer_scores(q, k, w, seg, 0.5)[20:35, :35]
    got = buf[:, :35]
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert rel_err(got[fin], ref[fin]) < 1e-5
    assert (buf[:, 35:] == 7.0).all()  # columns past the chunk's width are left alone
    keys = torch.zeros(15, T, dtype=torch.int64)
    ik.indexer_topk.indexer_scores(q, k, w, seg, 0.5, 20, 15, keys)
    kk = keys[:, :35]
    assert torch.equal(kk == torch.iinfo(torch.int64).min, torch.isneginf(ref))
    assert torch.equal(kk[fin] & 0xFFFFFFFF, torch.arange(35).expand(15, 35)[fin])  # low bits: key index
    by_key = got[fin][kk[fin].argsort()]
    assert (by_key[1:] >= by_key[:-1]).all()  # the int64 keys order like the fp32 scores


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_N=16, BLOCK_T=8, TOKS=4, num_warps=4, num_stages=1),   # the interpreter default (HI 4)
    dict(BLOCK_N=32, BLOCK_T=16, TOKS=1, num_warps=4, num_stages=1),  # one row per step
    dict(BLOCK_N=8, BLOCK_T=4, TOKS=8, num_warps=4, num_stages=1),    # a step spans past the program's rows
])
def test_indexer_scores_configs_and_windows(ik, cfg):
    """Keys-major programs: rows before the key block, rows whose window starts after it (documents), an
    arbitrary (non-monotone) seg_start, chunks starting mid-sequence; fp32 scores and int64 keys agree."""
    T = 45
    q, k, w = _indexer_inputs(T, seed=7)
    gen = torch.Generator().manual_seed(7)
    segs = {"docs": doc_seg_start(T, [3, 4, 20, 37]),
            "random": (torch.rand(T, generator=gen) * (torch.arange(T) + 1)).to(torch.int32)}  # any s <= t
    for name, seg in segs.items():
        ref_all = ref_indexer_scores(q, k, w, seg, 0.5)
        for r0, n in ((0, T), (9, 17), (40, 5)):
            ref = ref_all[r0:r0 + n, :r0 + n]
            buf = torch.full((n, T), 7.0)
            ik.indexer_topk.indexer_scores(q, k, w, seg, 0.5, r0, n, buf, config=cfg)
            got = buf[:, :r0 + n]
            assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), (name, r0)
            fin = torch.isfinite(ref)
            assert rel_err(got[fin], ref[fin]) < 1e-5, (name, r0)
            assert (buf[:, r0 + n:] == 7.0).all()
            keys = torch.zeros(n, T, dtype=torch.int64)
            ik.indexer_topk.indexer_scores(q, k, w, seg, 0.5, r0, n, keys, config=cfg)
            kk = keys[:, :r0 + n]
            assert torch.equal(kk == torch.iinfo(torch.int64).min, torch.isneginf(ref)), (name, r0)
            assert torch.equal(kk[fin] & 0xFFFFFFFF, torch.arange(r0 + n).expand(n, r0 + n)[fin])
            assert (keys[:, r0 + n:] == 0).all()


def test_indexer_topk_one_row_chunks_and_negative_scale(ik):
    """A cap below one row still makes progress (1-row chunks); a negative scale (folded into k) matches."""
    T, topk = 20, 5
    q, k, w = _indexer_inputs(T, seed=8)
    seg = doc_seg_start(T, [7])
    for scale in (0.5, -0.5):
        scores = ref_indexer_scores(q, k, w, seg, scale)
        idx = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, scale, mem_cap_bytes=1)
        assert torch.equal(idx, ref_indexer_topk(scores, topk))
        assert torch.equal(idx, ik.indexer_topk.indexer_topk(q, k, w, seg, topk, scale))


def test_indexer_topk_strided_inputs(ik):
    """q, k, w as strided views (heads and rows not packed), HI not a power of two."""
    T, HI, D, topk = 24, 5, 16, 4
    q, k, w = _indexer_inputs(T, HI=HI + 2, D=D + 8, seed=9)
    q, k, w = q[:, 1:HI + 1, :D], k[:, 4:D + 4], w[:, 2:HI + 2]
    seg = doc_seg_start(T, [10])
    idx = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, 0.4, mem_cap_bytes=8 * T * 7)
    assert torch.equal(idx, ref_indexer_topk(ref_indexer_scores(q, k, w, seg, 0.4), topk))


@pytest.mark.parametrize("select", ["threshold", "sort_keys"])
def test_indexer_topk_query_slices_match_the_whole_sequence(ik, select):
    """Queries given as slices at an offset into the keys (a context-parallel rank's runs) choose what the
    whole sequence's rows choose, row chunks included; the reference op agrees."""
    from lowerings.ops.indexer_topk import indexer_topk_reference

    T, topk = 40, 8
    q, k, w = _indexer_inputs(T, seed=11)
    seg = doc_seg_start(T, [9, 21, 22])
    whole = ik.indexer_topk.indexer_topk(q, k, w, seg, topk, 0.5, select=select)
    for a, b in ((0, 10), (10, 20), (20, 40), (33, 34)):
        for cap in (1 << 30, 4 * 40 * 3):
            part = ik.indexer_topk.indexer_topk(q[a:b], k, w[a:b], seg[a:b], topk, 0.5, select=select,
                                                mem_cap_bytes=cap, q_offset=a)
            assert torch.equal(part, whole[a:b]), (a, b, cap)
        ref = indexer_topk_reference(q[a:b], k, w[a:b], seg[a:b], topk, 0.5, a)
        assert torch.equal(ref, whole[a:b]), (a, b)
    with pytest.raises(ValueError, match="q_offset"):
        ik.indexer_topk.indexer_topk(q[30:], k, w[30:], seg[30:], topk, 0.5, q_offset=31)


def test_indexer_rejects_bad_inputs(ik):
    q, k, w = _indexer_inputs(8)
    seg = torch.zeros(8, dtype=torch.int32)
    f = ik.indexer_topk.indexer_topk
    with pytest.raises(ValueError, match="seg_start"):
        f(q, k, w, seg.long(), 4, 1.0)
    with pytest.raises(ValueError, match="w must be"):
        f(q, k, w[:, :2], seg, 4, 1.0)
    with pytest.raises(ValueError, match="k must be"):
        f(q, k[:, :3], w, seg, 4, 1.0)


# ----------------------------------------------------------------------------------------------------------
# SiTU-GLU (CPU interpreter)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_situ_glu_fwd_bwd(ik, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2 * 70, generator=gen) * 6  # F = 70: partial column block
    x[0, 0, :4] = torch.tensor([1e-6, -3e-4, 90.0, -300.0])  # tiny and saturated gates
    x[0, 0, 70:74] = torch.tensor([2e-6, -1e-3, 900.0, -3000.0])
    x = x.to(dtype)
    dy = torch.randn(3, 5, 70, generator=gen).to(dtype)
    xr = x.double().requires_grad_()
    ref = ref_situ_glu(xr, 4.0, 25.0)
    ref.backward(dy.double())
    y = ik.situ_glu.situ_glu_forward(x, 4.0, 25.0)
    dx = ik.situ_glu.situ_glu_backward(dy, x, 4.0, 25.0)
    assert y.shape == (3, 5, 70) and y.dtype == dtype and dx.shape == x.shape and dx.dtype == dtype
    assert rel_err(y, ref) < tol and rel_err(dx, xr.grad) < tol
    assert torch.isfinite(dx).all()


def test_situ_glu_betas_and_validation(ik):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 2 * 33, generator=gen) * 3
    xr = x.double().requires_grad_()
    ref = ref_situ_glu(xr, 2.5, 10.0)
    ref.sum().backward()
    assert rel_err(ik.situ_glu.situ_glu_forward(x, 2.5, 10.0), ref) < 1e-5
    assert rel_err(ik.situ_glu.situ_glu_backward(torch.ones(7, 33), x, 2.5, 10.0), xr.grad) < 1e-5
    with pytest.raises(ValueError, match="even"):
        ik.situ_glu.situ_glu_forward(torch.randn(4, 7))


# ----------------------------------------------------------------------------------------------------------
# AttnRes mix (CPU interpreter)


@pytest.mark.parametrize("m,H,dtype,tol", [(3, 70, torch.float32, 1e-5), (5, 40, torch.bfloat16, 1e-2),
                                           (0, 33, torch.float32, 1e-5)])
def test_attn_res_mix_fwd_bwd(ik, m, H, dtype, tol):
    N = 6
    gen = torch.Generator().manual_seed(m)
    bank = (torch.randn(N, m, H, generator=gen) * 2).to(dtype)
    part = torch.randn(N, H, generator=gen).to(dtype)
    g = (1 + 0.5 * torch.randn(H, generator=gen)).to(dtype)
    w = torch.randn(H, generator=gen).to(dtype)
    dout = torch.randn(N, H, generator=gen).to(dtype)
    ins = [t.double().requires_grad_() for t in (bank, part, g, w)]
    ref = ref_attn_res_mix(*ins, 1e-6)
    ref.backward(dout.double())
    out = ik.attn_res_mix.attn_res_mix_forward(bank, part, g, w, 1e-6)
    grads = ik.attn_res_mix.attn_res_mix_backward(dout, bank, part, g, w, 1e-6)
    assert out.dtype == dtype and rel_err(out, ref) < tol
    for got, r, src in zip(grads, ins, (bank, part, g, w)):
        assert got.shape == src.shape and got.dtype == src.dtype
        if r.grad.numel():
            assert rel_err(got, r.grad) < tol


def test_attn_res_mix_rows_per_program_and_determinism(ik, monkeypatch):
    """Several rows per backward program (the d_g/d_w partial path), bit-identical across runs."""
    monkeypatch.setattr(ik.attn_res_mix, "_MAX_PROGRAMS", 3)
    N, m, H = 8, 2, 24  # 3 programs x 3 rows, last one partly masked
    gen = torch.Generator().manual_seed(9)
    bank, part = torch.randn(N, m, H, generator=gen), torch.randn(N, H, generator=gen)
    g, w, dout = torch.randn(H, generator=gen), torch.randn(H, generator=gen), torch.randn(N, H, generator=gen)
    ins = [t.double().requires_grad_() for t in (bank, part, g, w)]
    ref_attn_res_mix(*ins, 1e-5).backward(dout.double())
    a = ik.attn_res_mix.attn_res_mix_backward(dout, bank, part, g, w, 1e-5)
    b = ik.attn_res_mix.attn_res_mix_backward(dout, bank, part, g, w, 1e-5)
    for x, y, r in zip(a, b, ins):
        assert torch.equal(x, y)
        assert rel_err(x, r.grad) < 1e-5


def test_attn_res_mix_validation(ik):
    with pytest.raises(ValueError, match="partial"):
        ik.attn_res_mix.attn_res_mix_forward(torch.randn(2, 3, 8), torch.randn(2, 7), torch.ones(8), torch.ones(8), 1e-6)


# ----------------------------------------------------------------------------------------------------------
# GPU: realistic shapes, compiled kernels (autotuned unless pytest --kernels-triton-autotune false)

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)


def _k3_sparse_problem(T: int, H: int, k: int, docs: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    seg = doc_seg_start(T, [i * T // docs for i in range(1, docs)], device=dev)
    idx = causal_topk_indices(T, k, seg, gen, device=dev)
    q = torch.randn(T, H, 576, generator=gen).to(dev, torch.bfloat16)
    kv = torch.randn(T, 576, generator=gen).to(dev, torch.bfloat16)
    dout = torch.randn(T, H, 512, generator=gen).to(dev, torch.bfloat16)
    return q, kv, idx, dout


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,H", [(4096, 96), (1024, 64), (1024, 128), (1024, 16)])
def test_gpu_sparse_mla_k3(T, H):
    from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

    scale = 192 ** -0.5
    q, kv, idx, dout = _k3_sparse_problem(T, H, 2048)
    out, lse = sparse_mla_forward(q, kv, idx, scale, 512)
    dq, dkv = sparse_mla_backward(dout, q, kv, idx, out, lse, scale, 512)
    torch.cuda.synchronize()
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, scale, 512, dout, chunk=256, compute_dtype=torch.float32)
    assert rel_err(out, ro) <= 1e-2
    assert_lse_close(lse, rl, 1e-2)
    assert rel_err(dq, rdq) <= 1e-2
    assert rel_err(dkv, rdkv) <= 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("which", ["fwd", "dq", "dkv"])
def test_gpu_sparse_mla_every_config(which):
    """Each autotune candidate on its own (a miscompiled config must not be silently picked)."""
    from lowerings.kernels import sparse_mla_bwd as B
    from lowerings.kernels import sparse_mla_fwd as F

    T, H, scale = 512, 96, 192 ** -0.5
    q, kv, idx, dout = _k3_sparse_problem(T, H, 2048, seed=1)
    ro, rl, rdq, rdkv = ref_sparse_mla_grads(q, kv, idx, scale, 512, dout, chunk=256, compute_dtype=torch.float32)
    cfgs = {"fwd": F.fwd_configs(H), "dq": B.dq_configs(H), "dkv": B.dkv_configs()}[which]
    failures = []
    for cfg in cfgs:
        try:
            if which == "fwd":
                out, lse = F.sparse_mla_forward(q, kv, idx, scale, 512, config=cfg)
                errs = (rel_err(out, ro),)
            else:
                out, lse = F.sparse_mla_forward(q, kv, idx, scale, 512)
                kw = {"dq_config": cfg} if which == "dq" else {"dkv_config": cfg}
                dq, dkv = B.sparse_mla_backward(dout, q, kv, idx, out, lse, scale, 512, **kw)
                errs = (rel_err(dq, rdq), rel_err(dkv, rdkv))
        except Exception as e:  # noqa: BLE001 - report every config, then fail
            failures.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if max(errs) > 1e-2:
            failures.append(f"{cfg}: rel err {errs}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@gpu
def test_gpu_indexer_topk_k3():
    from lowerings.kernels.indexer_topk import indexer_topk

    T, HI, D, topk = 4096, 64, 128, 2048
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, HI, D, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(T, D, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(T, HI, generator=gen) * (HI * D) ** -0.5).to("cuda")
    seg = doc_seg_start(T, [1000, 1001, 3000], device="cuda")
    scores = ref_indexer_scores(q, k, w, seg, D ** -0.5, compute_dtype=torch.float32)
    tol = 1e-4 * scores[torch.isfinite(scores)].abs().max().item()  # fp32 summation-order noise only
    for cap in (1 << 30, 16 << 20):  # one chunk; 1024-row chunks
        idx = indexer_topk(q, k, w, seg, topk, D ** -0.5, mem_cap_bytes=cap)
        assert_topk_valid(idx, scores, topk, tol=tol)
        # the same fp32 scores, the other selection: identical picks, ties included
        assert torch.equal(idx, indexer_topk(q, k, w, seg, topk, D ** -0.5, mem_cap_bytes=cap, select="sort_keys"))


@pytest.mark.gpu
@gpu
def test_gpu_indexer_scores_every_config():
    """Every autotune config (and the default) of the score kernel, fp32 scores and int64 keys, a chunk
    starting mid-sequence with documents, against the fp32 reference."""
    from lowerings.kernels.indexer_topk import default_scores_config, indexer_scores, scores_configs

    T, HI, D = 1536, 64, 128
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(T, HI, D, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(T, D, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(T, HI, generator=gen) * (HI * D) ** -0.5).to("cuda")
    seg = doc_seg_start(T, [300, 301, 1000], device="cuda")
    r0, n = 520, 1000
    ref = ref_indexer_scores(q, k, w, seg, D ** -0.5, compute_dtype=torch.float32)[r0:r0 + n, :r0 + n]
    fin = torch.isfinite(ref)
    failures = []
    for cfg in scores_configs(HI) + [default_scores_config(HI)]:
        buf = torch.full((n, T), 7.0, device="cuda")
        keys = torch.zeros(n, T, dtype=torch.int64, device="cuda")
        indexer_scores(q, k, w, seg, D ** -0.5, r0, n, buf, config=cfg)
        indexer_scores(q, k, w, seg, D ** -0.5, r0, n, keys, config=cfg)
        got, kk = buf[:, :r0 + n], keys[:, :r0 + n]
        ok = (torch.equal(torch.isneginf(got), ~fin) and rel_err(got[fin], ref[fin]) < 1e-4
              and bool((buf[:, r0 + n:] == 7.0).all()) and bool((keys[:, r0 + n:] == 0).all())
              and torch.equal(kk == torch.iinfo(torch.int64).min, ~fin))
        if not ok:
            failures.append(str(cfg))
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@gpu
def test_gpu_situ_glu():
    from lowerings.kernels.situ_glu import situ_glu_backward, situ_glu_forward

    gen = torch.Generator().manual_seed(0)
    # the experts' F = 3,072 in whole column blocks, a ragged row count, and F = 1,000 with a masked last block;
    # each at the shipped tiles and at tiles whose rows and columns differ from them
    for rows, F in ((4099, 3072), (8192, 1536), (513, 1000)):
        x = torch.randn(rows, 2 * F, generator=gen) * 4
        x[0, :4] = torch.tensor([1e-6, -3e-4, 90.0, -300.0])  # tiny and saturated gates and up values
        x[0, F:F + 4] = torch.tensor([2e-6, -1e-3, 900.0, -3000.0])
        x = x.to("cuda", torch.bfloat16)
        dy = torch.randn(rows, F, generator=gen).to("cuda", torch.bfloat16)
        xr = x.float().requires_grad_()
        ref = ref_situ_glu(xr)
        ref.backward(dy.float())
        for tiles in (None, (1, 256, 4), (8, 512, 8)):
            y, dx = situ_glu_forward(x, tiles=tiles), situ_glu_backward(dy, x, tiles=tiles)
            assert rel_err(y, ref) <= 1e-2 and rel_err(dx, xr.grad) <= 1e-2, (rows, F, tiles)
            assert torch.isfinite(dx).all()


@pytest.mark.gpu
@gpu
def test_gpu_attn_res_mix():
    from lowerings.kernels.attn_res_mix import attn_res_mix_backward, attn_res_mix_forward

    N, m, H = 4096, 16, 7168
    gen = torch.Generator().manual_seed(0)
    bank = torch.randn(N, m, H, generator=gen).to("cuda", torch.bfloat16)
    part = torch.randn(N, H, generator=gen).to("cuda", torch.bfloat16)
    g = (1 + 0.1 * torch.randn(H, generator=gen)).to("cuda")
    w = (torch.randn(H, generator=gen) * H ** -0.5).to("cuda")
    dout = torch.randn(N, H, generator=gen).to("cuda", torch.bfloat16)
    ins = [t.float().requires_grad_() for t in (bank, part, g, w)]
    ref = ref_attn_res_mix(*ins, 1e-6)
    ref.backward(dout.float())
    assert rel_err(attn_res_mix_forward(bank, part, g, w, 1e-6), ref) <= 1e-2
    for got, r in zip(attn_res_mix_backward(dout, bank, part, g, w, 1e-6), ins):
        assert rel_err(got, r.grad) <= 1e-2
