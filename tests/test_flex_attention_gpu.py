"""kernels.causal_attention = flex on one GPU at k3_small's MLA shape, against an fp32 SDPA masked reference.

B = 1, S = 8,192, 16 heads, qk head dim 192, v head dim 128, bf16; packed documents of about 100 and about 2,000
tokens, one document (plain causal), and a context-parallel rank's two pieces against the whole row. Output and
the gradients of q, k, v within 1e-2 relative L2 error, from eager code (the op's compiled wrapper) and from
inside a fullgraph-compiled function (the model's path).
    python -m pytest -m gpu tests/test_flex_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowerings.ops import causal_attention, document_causal_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S, H, DQK, DV = 8192, 16, 192, 128
TOL = 1e-2


def seg_start_of(mean_len: int | None, seq: int = S, seed: int = 0) -> torch.Tensor | None:
    """Row-local segment starts of documents of mean_len +- 50% tokens (None: one document, plain causal)."""
    if mean_len is None:
        return None
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], 0
    while pos < seq:
        n = min(seq - pos, int(torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (1,), generator=g)))
        starts += [pos] * n
        pos += n
    return torch.tensor([starts], dtype=torch.int32, device="cuda")


def inputs(sq: int, sk: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, sq, H, DQK, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, sk, H, DQK, device="cuda", generator=g).bfloat16().requires_grad_()
    v = torch.randn(1, sk, H, DV, device="cuda", generator=g).bfloat16().requires_grad_()
    return q, k, v


def fp32_reference(q, k, v, scale, seg_start, q_positions, grad_out):
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q32, k32, v32))
    if seg_start is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        mask = document_causal_mask(seg_start, q_positions, k.shape[1])
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    return (out, *torch.autograd.grad(out, (q32, k32, v32), grad_out.float()))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-call", "inside-compile"])
# unaligned: a row of 8,000 tokens, not a multiple of the 128-token blocks (the mask_mod runs on padded rows)
@pytest.mark.parametrize("case", ["docs100", "docs2000", "one-document", "cp-pieces", "unaligned"])
def test_flex_matches_sdpa_at_k3_small(flex_backend, case, compiled):
    scale = DQK**-0.5
    q_positions = None
    if case == "cp-pieces":  # a rank of 2 under the zigzag layout: pieces 0 and 3 of 4, against all keys
        whole = seg_start_of(100)
        pos = torch.cat([torch.arange(0, S // 4), torch.arange(3 * S // 4, S)]).cuda()
        seg_start, q_positions = whole[:, pos], pos.unsqueeze(0)
    elif case == "unaligned":
        seg_start = seg_start_of(100, seq=8000)
    else:
        seg_start = seg_start_of({"docs100": 100, "docs2000": 2000, "one-document": None}[case])
    row = 8000 if case == "unaligned" else S
    q, k, v = inputs(S // 2 if case == "cp-pieces" else row, row)

    def attend(q, k, v, seg_start, q_positions):
        return causal_attention(q, k, v, scale=scale, seg_start=seg_start, q_positions=q_positions)

    torch._dynamo.reset()  # each case compiles for its own static shapes, as a training run does
    fn = torch.compile(attend, fullgraph=True) if compiled else attend
    out = fn(q, k, v, seg_start, q_positions)
    grad_out = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    want = fp32_reference(q, k, v, scale, seg_start, q_positions, grad_out)
    errors = {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e < TOL for e in errors.values()), errors
