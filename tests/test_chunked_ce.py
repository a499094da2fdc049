"""Chunked linear cross-entropy equals the full cross-entropy (value and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from lowerings import ops


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_equals_full_ce(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 21))
    labels[0, :5] = -100
    labels[2, -3:] = -100
    normalizer = 40.0  # e.g. valid tokens over the whole step, not just this batch
    loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=normalizer, chunk_size=chunk)
    ref = F.cross_entropy((hidden @ weight.t()).view(-1, 50), labels.view(-1), ignore_index=-100, reduction="sum") / normalizer
    assert torch.allclose(loss, ref, rtol=1e-6)
    g = torch.autograd.grad(2.5 * loss, [hidden, weight])
    g_ref = torch.autograd.grad(2.5 * ref, [hidden, weight])
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_ce_all_ignored_gives_zero_and_rejects_bad_args():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8)
    labels = torch.full((4,), -100)
    loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=0, chunk_size=2)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_cross_entropy(hidden, weight, labels, normalizer=1, chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        ops.linear_cross_entropy(hidden, weight, labels[:3], normalizer=1)
