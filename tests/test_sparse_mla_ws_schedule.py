"""The Gluon sparse-MLA forward's softmax bookkeeping, replayed in PyTorch on the CPU.

Two warpgroups own alternate 64-key blocks; each keeps its own running max m and row sum l for its half of O.
The owner of a block publishes P (bf16) relative to its row reference r = max(m_owner, rowmax); the other
warpgroup cannot rescale that P on its way into wgmma, so it holds O as acc * pend and divides acc by
f = 2^(r - m) (clamped at 2^-64). This replays exactly that arithmetic (fp32, bf16 P) against an fp64 softmax,
including score spreads where f underflows and blocks with no valid key, so a change to the scheme is checked
in CI; the GPU tests in test_sparse_mla_ws.py check the kernel itself.
"""

from __future__ import annotations

import pytest
import torch

BN = 64
F_MIN = 2.0 ** -64


def _replay(s2: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s2 [H, K] scores in log2 units (-inf = masked), v [K, D] -> out [H, D], lse2 [H] as the kernel computes them."""
    H, K = s2.shape
    halves = v.float().chunk(2, dim=1)
    n_pairs = -(-K // (2 * BN))
    s2 = torch.nn.functional.pad(s2, (0, 2 * BN * n_pairs - K), value=float("-inf"))  # the all-masked pad block
    vp = [torch.nn.functional.pad(h, (0, 0, 0, 2 * BN * n_pairs - K)) for h in halves]
    m = [torch.full((H,), float("-inf")) for _ in range(2)]
    l = [torch.zeros(H) for _ in range(2)]
    pend = [torch.ones(H) for _ in range(2)]
    acc = [torch.zeros(H, halves[0].shape[1]) for _ in range(2)]
    for i in range(n_pairs):
        published = []
        for w in range(2):  # each warpgroup's own block: scores, softmax, publish, own PV
            blk = slice((2 * i + w) * BN, (2 * i + w + 1) * BN)
            sc = s2[:, blk]
            r = torch.maximum(m[w], sc.max(dim=1).values)
            p = torch.exp2(sc - torch.where(r == float("-inf"), 0.0, r)[:, None])
            rs = p.sum(dim=1)
            p16 = p.to(torch.bfloat16).float()
            published.append((p16, r, rs, blk))
            alpha = torch.exp2(m[w] - torch.where(r == float("-inf"), 0.0, r))
            acc[w] = acc[w] * (pend[w] * alpha)[:, None] + p16 @ vp[w][blk]
            pend[w] = torch.ones(H)
            l[w] = l[w] * alpha + rs
            m[w] = r
        for w in range(2):  # the other warpgroup's block, its P straight from shared memory
            p16, r, rs, blk = published[1 - w]
            m_new = torch.maximum(m[w], r)
            m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp2(m[w] - m_use)
            f = torch.exp2(r - m_use)
            f_c = torch.clamp(f, min=F_MIN)
            l[w] = l[w] * alpha + f * rs
            m[w] = m_new
            acc[w] = acc[w] * (pend[w] * alpha / f_c)[:, None] + p16 @ vp[w][blk]
            pend[w] = f_c
    out = [acc[w] * pend[w][:, None] / torch.where(l[w] > 0, l[w], 1.0)[:, None] for w in range(2)]
    lse2 = torch.where(l[0] > 0, m[0] + torch.log2(torch.where(l[0] > 0, l[0], 1.0)), float("-inf"))
    assert torch.isfinite(torch.cat(acc, dim=1)).all()  # acc / f stays far from fp32 overflow
    return torch.cat(out, dim=1), lse2


@pytest.mark.parametrize("K,spread,hole", [(2048, 1.0, 0.0), (300, 1.0, 0.3), (1000, 60.0, 0.3), (2048, 400.0, 0.0)])
def test_two_reference_softmax_matches_exact(K, spread, hole):
    # spread 60 / 400: block maxima differ by hundreds of log2 units, so f underflows and is clamped
    gen = torch.Generator().manual_seed(K + int(spread))
    H, D = 16, 64
    s2 = spread * torch.randn(H, K, generator=gen, dtype=torch.float64)
    s2[torch.rand(H, K, generator=gen) < hole] = float("-inf")
    s2[3, : 2 * BN] = float("-inf")  # a row whose first pair has no valid key
    s2[4, BN:] = float("-inf")  # only the first warpgroup's first block is valid
    s2[5] = float("-inf")  # no valid key at all: out 0, lse -inf
    v = torch.randn(K, D, generator=gen, dtype=torch.float64)
    out, lse2 = _replay(s2.float(), v)
    valid = torch.isfinite(s2).any(dim=1)
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    exact = torch.softmax(s2[valid] * ln2, dim=1) @ v  # 2^s = e^(s ln 2)
    rel = (out[valid].double() - exact).norm() / exact.norm()
    assert rel <= 1e-2, rel
    assert torch.allclose(lse2[valid].double(), torch.logsumexp(s2[valid] * ln2, dim=1) / ln2, rtol=1e-5, atol=1e-3)
    assert torch.equal(out[5], torch.zeros(D)) and torch.isneginf(lse2[5])
