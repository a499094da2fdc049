"""kernels.causal_attention = flex against the SDPA masked reference (CPU): values, gradients, the BlockMask's
blocks, and a fullgraph compile that neither breaks nor recompiles when the document count changes."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from lowerings.ops import causal_attention, configure_backends, document_causal_mask, op_backends
from lowerings.kernels.flex_attention import document_causal_block_mask, flex_causal_attention


def _seg_start(doc_lengths: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in doc_lengths:
        starts = []
        for n in lengths:
            starts += [len(starts)] * n
        rows.append(starts)
    return torch.tensor(rows, dtype=torch.int32)


def _inputs(B, Sq, Sk, H=2, dqk=48, dv=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, dqk, generator=g, requires_grad=True)
    k = torch.randn(B, Sk, H, dqk, generator=g, requires_grad=True)
    v = torch.randn(B, Sk, H, dv, generator=g, requires_grad=True)
    return q, k, v


def _reference(q, k, v, scale, seg_start, q_positions):
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
    if seg_start is None:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)
    else:
        mask = document_causal_mask(seg_start, q_positions, k.shape[1])
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# Row lengths 300 > the 128-token blocks; documents of length 1, odd, longer than a block, one row of a single
# document (crossing no boundary).
PACKED = [[1, 7, 150, 13, 1, 128], [300]]


@pytest.mark.parametrize("case", ["packed", "causal", "rectangular"])
def test_flex_matches_the_sdpa_reference_forward_and_grads(flex_backend, case):
    scale = 48**-0.5
    if case == "packed":
        seg_start, q_positions = _seg_start(PACKED), None
        q, k, v = _inputs(2, 300, 300)
    elif case == "causal":
        seg_start, q_positions = None, None
        q, k, v = _inputs(2, 200, 200)
    else:  # a context-parallel rank's two pieces of each row (zigzag: 1st and 4th of 4) against the whole row
        whole = _seg_start(PACKED)
        pos = torch.cat([torch.arange(0, 75), torch.arange(225, 300)])
        seg_start, q_positions = whole[:, pos], pos.expand(2, -1).contiguous()
        q, k, v = _inputs(2, 150, 300)
    out = causal_attention(q, k, v, scale=scale, seg_start=seg_start, q_positions=q_positions)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = _reference(q, k, v, scale, seg_start, q_positions)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert out.shape == ref.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    assert _rel(out, ref) < 1e-5
    for name, g, r in zip("qkv", grads, ref_grads):
        assert _rel(g, r) < 1e-5, name


def _block_dense(num_blocks, indices, nk):
    B, H, nq = num_blocks.shape
    dense = torch.zeros(B, H, nq, nk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                dense[b, h, i, indices[b, h, i, : num_blocks[b, h, i]].long()] = True
    return dense


@pytest.mark.parametrize("case", ["packed", "rectangular"])
def test_block_mask_lists_exactly_the_blocks_the_mask_touches(case):
    if case == "packed":
        seg_start, q_positions, Sq, Sk = _seg_start(PACKED), None, 300, 300
    else:  # block-aligned pieces, so that some query blocks hold whole key blocks
        whole = _seg_start([[1, 7, 150, 13, 1, 128, 212], [512]])
        pos = torch.cat([torch.arange(0, 128), torch.arange(384, 512)])
        seg_start, q_positions, Sq, Sk = whole[:, pos], pos.expand(2, -1).contiguous(), 256, 512
    bm = document_causal_block_mask(seg_start, q_positions, batch=2, q_len=Sq, kv_len=Sk, device=torch.device("cpu"))
    dense = document_causal_mask(seg_start, q_positions, Sk)  # [B,1,Sq,Sk]
    nq, nk = -(-Sq // 128), -(-Sk // 128)
    padded = F.pad(dense, (0, nk * 128 - Sk, 0, nq * 128 - Sq)).view(2, 1, nq, 128, nk, 128)
    touched = padded.any(5).any(3)
    full = padded.all(5).all(3)  # a block holding padding is partial: the mask_mod runs on it
    partial = _block_dense(bm.kv_num_blocks, bm.kv_indices, nk)
    full_listed = _block_dense(bm.full_kv_num_blocks, bm.full_kv_indices, nk)
    assert torch.equal(partial | full_listed, touched)
    assert torch.equal(full_listed, full)
    assert not (partial & full_listed).any()
    assert full.any() and (touched & ~full).any()  # both kinds occur, so the check means something


def test_compiled_forward_uses_the_block_lists_on_cpu():
    """Inductor's CPU flex kernel walks the BlockMask's block lists (the math reference does not)."""
    seg_start = _seg_start(PACKED)
    q, k, v = (x.detach() for x in _inputs(2, 300, 300))
    scale = 48**-0.5
    compiled = torch.compile(flex_causal_attention, fullgraph=True)
    out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, seg_start=seg_start)
    ref = _reference(q, k, v, scale, seg_start, None)
    assert _rel(out.transpose(1, 2), ref) < 1e-5


def test_fullgraph_compile_does_not_recompile_when_the_document_count_changes(flex_backend):
    def attend(q, k, v, seg_start):
        return causal_attention(q, k, v, scale=0.125, seg_start=seg_start) * 2

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for i, lengths in enumerate([[[100, 100, 56]] * 2, [[10] * 25 + [6]] * 2, [[256], [1, 255]], [[3, 253]] * 2]):
        seg_start = _seg_start(lengths)
        q, k, v = _inputs(2, 256, 256, seed=i)
        out = compiled(q, k, v, seg_start)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref = _reference(q, k, v, 0.125, seg_start, None) * 2
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        assert _rel(out, ref) < 1e-5
        assert all(_rel(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("rows, dynamic, takes_flex", [(100, True, False), (100, False, False), (128, False, True),
                                                     (256, True, True)])
def test_unaligned_rows_take_sdpa_under_compile(flex_backend, monkeypatch, rows, dynamic, takes_flex):
    """Inductor's flex lowering fails on symbolic row lengths that are not multiples of 128 (torch 2.11 on the
    H200), and a traced model cannot tell a symbolic length from a static one: under a compile unaligned rows
    take sdpa (still exact), aligned ones flex."""
    import lowerings.kernels.flex_attention as flex_module

    calls = []
    real = flex_module.flex_causal_attention
    monkeypatch.setattr(flex_module, "flex_causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def attend(q, k, v, seg_start):
        return causal_attention(q, k, v, scale=0.125, seg_start=seg_start)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    seg_start = _seg_start([[rows - 40, 40]])
    q, k, v = _inputs(1, rows, rows)
    out = compiled(q, k, v, seg_start)
    assert _rel(out, _reference(q, k, v, 0.125, seg_start, None)) < 1e-5
    assert bool(calls) == takes_flex


def test_unknown_backend_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"kernels.causal_attention = 'flash' is not a backend of causal_attention; "
                                         r"valid: \['auto', 'sdpa', 'flex', 'varlen'\]"):
        configure_backends({"causal_attention": "flash"})


def test_config_key_refuses_an_unknown_backend_naming_the_valid_ones():
    from titan_kimi.config import ConfigError, load_job_config

    with pytest.raises(ConfigError, match=r'kernels.causal_attention = "flash".*valid: one of auto\|sdpa\|flex'):
        load_job_config(["--kernels.causal_attention", "flash"], environ={})
    assert load_job_config(["--kernels.causal_attention", "flex"], environ={}).kernels.causal_attention == "flex"


def test_auto_takes_flex_on_cuda_only(monkeypatch):
    """flex runs on CPU when named (torch's math reference), but auto takes it only where CUDA is: there it was
    measured faster on packed documents (docs/perf.md). Where varlen cannot run, flex is auto's CUDA choice."""
    import lowerings.ops.registry as registry

    backends = op_backends("causal_attention")
    saved = registry.resolved_backends()
    monkeypatch.setitem(backends.checks, "varlen", lambda: "no flash varlen kernel")
    try:
        monkeypatch.setitem(backends.auto_checks, "flex", lambda: "no CUDA device")
        assert configure_backends({"causal_attention": "auto"}) == {"causal_attention": "sdpa"}
        assert configure_backends({"causal_attention": "flex"}) == {"causal_attention": "flex"}
        monkeypatch.setitem(backends.auto_checks, "flex", registry.always_available)
        assert configure_backends({"causal_attention": "auto"}) == {"causal_attention": "flex"}
    finally:
        registry.install_backends(saved)
