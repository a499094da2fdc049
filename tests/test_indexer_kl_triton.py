"""The indexer-distillation Triton kernels (lowerings/kernels/indexer_kl.py) against the row-chunked references
on fresh random inputs: under the CPU interpreter at tiny shapes, and (@pytest.mark.gpu) at k31_small's shape in
bf16, forward and backward."""

import pytest
import torch

from lowerings.ops import indexer_kl_reference as ref
from lowerings.ops.indexer_topk import indexer_topk_reference

from test_triton_kernels import _interp_mods, ik  # noqa: F401 (fixtures)


def packed(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.cat([torch.full((n,), sum(lengths[:i]), dtype=torch.int32) for i, n in enumerate(lengths)]).to(device)


def make(T: int, H: int, D: int, HI: int, DI: int, dtype=torch.float32, device="cpu", seed=0, Tk=None):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=g, device=device) * std)
    Tk = Tk or T
    return dict(iq=r(T, HI, DI).to(dtype), ik=r(Tk, DI).to(dtype), iw=r(T, HI).abs() * HI**-0.5,
                q=r(T, H, D, std=2.0).to(dtype), kv=r(Tk, D).to(dtype))


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def check_dense(mod, t, seg, q_offset, bound, config=None):
    scale, iscale = t["q"].shape[-1] ** -0.5, t["iq"].shape[-1] ** -0.5
    f32 = {k: v.float() for k, v in t.items()}
    lse = mod.attention_lse(t["q"], t["kv"], seg, scale, q_offset, config=config)
    lse_ref = ref.attention_lse_reference(f32["q"], f32["kv"], seg, scale, q_offset)
    assert rel(lse, lse_ref) < bound
    kl, stats = mod.dense_kl(t["iq"], t["ik"], t["iw"], t["q"], t["kv"], lse_ref, seg, q_offset, iscale, scale,
                             config=config)
    kl_ref, stats_ref = ref.dense_kl_reference(f32["iq"], f32["ik"], f32["iw"], f32["q"], f32["kv"], lse_ref, seg,
                                               q_offset, iscale, scale)
    assert rel(kl, kl_ref) < bound and rel(stats, stats_ref) < bound
    grad = torch.rand(kl.shape[0], generator=torch.Generator().manual_seed(9)).to(kl.device)
    got = mod.dense_kl_backward(grad, t["iq"], t["ik"], t["iw"], t["q"], t["kv"], lse_ref, seg, stats, q_offset,
                                iscale, scale, config=config)
    want = ref.dense_kl_backward_reference(grad, f32["iq"], f32["ik"], f32["iw"], f32["q"], f32["kv"], lse_ref, seg,
                                           q_offset, iscale, scale)
    for name, a, b in zip(("dq", "dk", "dw"), got, want):
        assert rel(a, b) < bound, (name, rel(a, b))


def check_sparse(mod, t, seg, k, bound, config=None):
    scale, iscale = t["q"].shape[-1] ** -0.5, t["iq"].shape[-1] ** -0.5
    f32 = {n: v.float() for n, v in t.items()}
    idx = indexer_topk_reference(f32["iq"], f32["ik"], f32["iw"], seg, k, iscale)
    lse = ref.attention_lse_reference(f32["q"], f32["kv"], seg, scale)  # any per-head LSE: p is L1-normalised
    p = mod.sparse_target(t["q"], t["kv"], lse, idx, scale, config=config)
    assert rel(p, ref.sparse_target_reference(f32["q"], f32["kv"], lse, idx, scale)) < bound
    scores = mod.scores_at(t["iq"], t["ik"], t["iw"], idx, iscale, config=config)
    want = ref.scores_at_reference(f32["iq"], f32["ik"], f32["iw"], idx, iscale)
    assert torch.equal(torch.isinf(scores), idx < 0) and rel(scores[idx >= 0], want[idx >= 0]) < bound
    d_scores = torch.randn(idx.shape, generator=torch.Generator().manual_seed(8)).to(scores.device)
    got = mod.scores_at_backward(d_scores, t["iq"], t["ik"], t["iw"], idx, iscale, config=config)
    want = ref.scores_at_backward_reference(d_scores, f32["iq"], f32["ik"], f32["iw"], idx, iscale)
    for name, a, b in zip(("dq", "dk", "dw"), got, want):
        assert rel(a, b) < bound, (name, rel(a, b))


# fp32 under the interpreter (bf16 on the GPU below). Its default tiles are 16 keys and 16 heads per step, so
# H = 20 takes two head blocks and D = 40 a 32 + 8 split; documents longer than 16 span several key blocks.
def test_dense_kernels_match_the_reference_with_packed_documents(ik):
    check_dense(ik.indexer_kl, make(34, 20, 40, 4, 16), packed([18, 3, 13]), 0, 1e-5)


def test_dense_kernels_on_a_slice_of_queries_against_the_whole_rows_keys(ik):
    """Context parallelism's call: queries 20..39 of a 48-token row (q_offset 20)."""
    seg = packed([13, 35])[20:32]
    check_dense(ik.indexer_kl, make(12, 3, 24, 2, 16, seed=1, Tk=48), seg.contiguous(), 20, 1e-5)


def test_sparse_kernels_match_the_reference_with_packed_documents(ik):
    check_sparse(ik.indexer_kl, make(36, 20, 40, 4, 16, seed=2), packed([21, 3, 12]), 18, 1e-5)


def hot_and_cold_idx(T: int, Tk: int, k: int, hot: int, seed=0) -> torch.Tensor:
    """[T, k] int32 selections over keys [0, hot) only: key 0 in every row, the rest distinct random keys, about
    a quarter of the other slots -1; keys hot..Tk-1 are selected by no row."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(hot - 1, generator=g)[:k - 1]])
                       for _ in range(T)]).to(torch.int32)
    drop = torch.rand(T, k, generator=g) < 0.25
    drop[:, 0] = False
    return idx.masked_fill(drop, -1)


@pytest.mark.parametrize("row_chunks", [1, 3])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sparse_backward_with_a_hot_key_unselected_keys_and_empty_slots(ik, dtype, bound, row_chunks):
    """dk's key-major pass: key 0 is selected by all 37 rows (three 16-row chunks of its run in the
    interpreter), keys 30..44 by none (dk exactly 0), scattered -1 slots; T = 37 and Tk = 45 are no multiple of
    the 16-wide blocks, DI = 24 is no power of two. ``row_chunks`` = 3: a workspace of 13 rows' slots, so dk adds
    three chunks of rows (13, 13, 11)."""
    T, Tk, k, HI, DI = 37, 45, 12, 4, 24
    t = make(T, 2, 16, HI, DI, dtype, seed=4, Tk=Tk)
    idx = hot_and_cold_idx(T, Tk, k, hot=30, seed=5)
    iscale = DI**-0.5
    d_scores = torch.randn(idx.shape, generator=torch.Generator().manual_seed(6))
    workspace = {} if row_chunks == 1 else {"workspace_bytes": 13 * k * DI * t["iq"].element_size()}
    got = ik.indexer_kl.scores_at_backward(d_scores, t["iq"], t["ik"], t["iw"], idx, iscale, **workspace)
    want = ref.scores_at_backward_reference(d_scores, t["iq"].float(), t["ik"].float(), t["iw"], idx, iscale)
    for name, a, b in zip(("dq", "dk", "dw"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert rel(a, b) < bound, (name, rel(a, b))
    assert torch.count_nonzero(got[1][30:]) == 0 and torch.count_nonzero(got[1][0]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_kernels_at_k31_small_shape_in_bf16(mode):
    """T = 4,096 (two documents), 16 heads x 576 (absorbed MLA), 64 x 128 indexer heads, top-2,048."""
    from lowerings.kernels import indexer_kl

    seg = packed([1500, 2596], device="cuda")
    t = make(4096, 16, 576, 64, 128, torch.bfloat16, device="cuda", seed=3)
    if mode == "dense":
        check_dense(indexer_kl, t, seg, 0, 2e-2)
    else:
        check_sparse(indexer_kl, t, seg, 2048, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 96])
def test_sparse_mla_backward_target_matches_the_reference_at_k31_shapes_in_bf16(H):
    """The target the sparse stage's gradient uses: the Triton sparse-MLA backward's head-summed probabilities
    (``head_mass``, normalised) against the row-chunked reference from the forward's LSE; 16 heads (one head
    block) and K3.1's 96 (three blocks, atomic adds), T = 4,096 in two documents, top-2,048, bf16."""
    from lowerings.kernels.sparse_mla_bwd import sparse_mla_backward
    from lowerings.kernels.sparse_mla_fwd import sparse_mla_forward

    seg = packed([1500, 2596], device="cuda")
    t = make(4096, H, 576, 64, 128, torch.bfloat16, device="cuda", seed=11)
    f32 = {n: v.float() for n, v in t.items()}
    scale, iscale = 576**-0.5, 128**-0.5
    idx = indexer_topk_reference(f32["iq"], f32["ik"], f32["iw"], seg, 2048, iscale)
    out, lse = sparse_mla_forward(t["q"], t["kv"], idx, scale, 512)
    dout = torch.randn_like(out)
    dq, dkv, mass = sparse_mla_backward(dout, t["q"], t["kv"], idx, out, lse, scale, 512, head_mass=True)
    dq0, dkv0 = sparse_mla_backward(dout, t["q"], t["kv"], idx, out, lse, scale, 512)
    want = ref.sparse_target_reference(f32["q"], f32["kv"], lse, idx, scale)
    assert rel(ref.normalise(mass), want) < 2e-2
    assert torch.equal(mass[idx < 0], torch.zeros_like(mass[idx < 0]))
    assert torch.equal(dq, dq0) and rel(dkv, dkv0) < 1e-3
