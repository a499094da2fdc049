"""The EP rank's row permutation as gathers against torchtitan's ``_permute`` / ``_unpermute``: the same rows
in the same slots, and the same gradients of the rows and of a per-slot weight, on fresh random inputs."""

import pytest
import torch
from torchtitan.models.moe.utils import _permute, _unpermute

from titan_kimi.parallel.expert_parallel import _permutation_on_any_device
from titan_kimi.parallel.expert_permutation import permute, row_permutation, unpermute


@pytest.mark.parametrize("counts", [[5, 0, 3, 7, 1, 2], [0, 0, 4, 9, 0, 6], [16, 16, 16, 16, 16, 16]])
def test_gathers_match_torchtitans_permutation(counts):
    _permutation_on_any_device()  # torchtitan's index generation on the CPU
    ep, local, dim = 2, 3, 8
    gen = torch.Generator().manual_seed(sum(counts))
    counts = torch.tensor(counts)
    rows = int(counts.sum())
    x = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    g = torch.randn(rows, dim, generator=gen, dtype=torch.float64)

    def run(perm_fn, unperm_fn):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        shape, slots, indices, aligned = perm_fn(xi, counts, ep, local)
        out = unperm_fn(torch.tanh(slots @ wi), shape, indices)
        (out * g).sum().backward()
        return slots.detach(), out.detach(), aligned, xi.grad, wi.grad, indices

    ref_slots, ref_out, ref_aligned, ref_gx, ref_gw, ref_idx = run(_permute, _unpermute)
    slots, out, aligned, gx, gw, perm = run(permute, unpermute)
    real = ref_idx >= 0
    assert torch.equal(aligned, ref_aligned) and slots.shape == ref_slots.shape
    assert torch.equal(slots[real], ref_slots[real]) and torch.equal(perm.padding, (~real).nonzero().squeeze(1))
    assert out.shape == ref_out.shape == x.shape
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-12, atol=1e-12)
    # padding slots (zeros there, row copies here) get zero output gradients: the weight's gradient agrees
    torch.testing.assert_close(gw, ref_gw, rtol=1e-12, atol=1e-12)


def test_inverse_positions_of_a_permutation_with_padding():
    index = torch.tensor([3, 0, -1, -1, 2, 1, -1, 4])
    perm = row_permutation(index, 5)
    assert perm.inverse.tolist() == [1, 5, 4, 0, 7]
    assert perm.gather.tolist() == [3, 0, 0, 0, 2, 1, 0, 4]
    assert perm.padding.tolist() == [2, 3, 6]
