"""Top-k selection from fp32 scores + the k-th value (lowerings/kernels/topk_select.py) against the reference
`select_topk`, and that against its rule (stable sort of the reversed row: the most recent key wins ties). CPU:
Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from lowerings.kernels.topk_select import select_topk_by_threshold
from lowerings.ops.indexer_topk import select_topk


def stable_sort_rule(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The rule written as a sort: stable descending sort of the reversed row, the first k finite columns, ascending,
    -1 for the slots without one."""
    last = scores.shape[-1] - 1
    values, order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True)
    idx = torch.where(torch.isfinite(values[..., :k]), last - order[..., :k], torch.full_like(order[..., :k], last + 1))
    idx = idx.sort(dim=-1).values
    return torch.where(idx == last + 1, torch.full_like(idx, -1), idx).to(torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_selection_is_the_stable_sort_rule(seed):
    """select_topk (a partial top-k over score-then-column keys) picks what the stable sort picks, ties included."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (16, 90), generator=gen).float().relu()
    scores = scores * torch.where(torch.rand(16, 1, generator=gen) < 0.5, -1.0, 1.0)  # -0.0 beside 0.0
    scores[torch.rand(16, 90, generator=gen) < 0.25] = float("-inf")
    scores[2] = float("-inf")
    scores[3, 4:] = float("-inf")
    for k in (1, 7, 90):
        assert torch.equal(select_topk(scores, k), stable_sort_rule(scores, k)), k


def _select(scores: torch.Tensor, k: int, block: int = 16) -> torch.Tensor:
    R, W = scores.shape
    kk = min(k, W)
    thr = torch.topk(scores, kk, dim=1, sorted=False).values.min(dim=1).values
    out = torch.full((R, kk), -1, dtype=torch.int32)
    return select_topk_by_threshold(scores, thr, torch.full((R,), W, dtype=torch.int32), out, block=block)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_with_many_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    R, W, k = 12, 70, 9
    scores = torch.randint(0, 4, (R, W), generator=gen).float()  # four values: ties everywhere
    scores[torch.rand(R, W, generator=gen) < 0.2] = float("-inf")
    scores[3, 5:] = float("-inf")  # fewer finite keys than k
    scores[4] = float("-inf")  # no key at all
    scores[5, ::2] = -0.0  # signed zeros tie with +0.0
    scores[5, 1::2] = 0.0
    got = _select(scores, k)
    assert torch.equal(got, select_topk(scores, k))
    assert (got[4] == -1).all() and (got[3, 5:] == -1).all()


def test_distinct_scores_and_block_boundaries():
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(5, 100, generator=gen)
    for block in (16, 32, 128):
        assert torch.equal(_select(scores, 17, block), select_topk(scores, 17))


def test_row_end_limits_the_scan():
    scores = torch.arange(10, dtype=torch.float32).repeat(2, 1)
    thr = torch.tensor([2.0, 6.0])  # k-th value within the first 5 / 9 columns for k = 3
    out = torch.full((2, 3), -1, dtype=torch.int32)
    select_topk_by_threshold(scores, thr, torch.tensor([5, 9], dtype=torch.int32), out, block=4)
    assert out.tolist() == [[2, 3, 4], [6, 7, 8]]


def test_bad_inputs_name_the_value():
    s = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="scores must be fp32"):
        select_topk_by_threshold(s.double(), torch.zeros(2), torch.zeros(2, dtype=torch.int32),
                                 torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_end must be int32"):
        select_topk_by_threshold(s, torch.zeros(2), torch.zeros(2), torch.zeros(2, 2, dtype=torch.int32))
