"""The expert-parallel rank's row permutation (received rows grouped by local expert, each group padded to the
grouped GEMM's alignment, and back) as two row gathers, forward and backward.

torchtitan's ``_permute`` appends a zero row (a copy of every received row), gathers with advanced indexing
(whose backward is a sort-based accumulating ``index_put``) and ``_unpermute`` scatters back with ``index_put``
(an element-wise indexing kernel). Every received row sits at exactly one place of the permuted order, so both
directions are gathers once the inverse positions are known: on one H100 at k31.toml's 65,536 received rows x
3,584 those kernels took ~10 ms of a KDA + MoE layer's forward and backward (docs/perf.md). Padding slots
(index -1) read a copy of a real row instead of zeros: their outputs are never read and their output gradients
are zero, so the experts' weight gradients are the same.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowPermutation(NamedTuple):
    """``gather``: the permuted order's source row per slot (padding slots clamped to row 0); ``inverse``: each
    received row's slot; ``padding``: the padding slots' positions."""

    gather: torch.Tensor
    inverse: torch.Tensor
    padding: torch.Tensor


def row_permutation(permuted_indices: torch.Tensor, rows: int) -> RowPermutation:
    """From torchtitan's ``permuted_indices`` (a source row per slot, -1 for padding) over ``rows`` rows."""
    index = permuted_indices.long()
    slots = index.numel()
    padding = index < 0
    positions = torch.arange(slots, device=index.device)
    # padding slots write past the received rows, so every write has its own target (no duplicate scatter)
    targets = torch.where(padding, rows + positions, index)
    inverse = torch.zeros(rows + slots, dtype=torch.long, device=index.device).scatter_(0, targets, positions)
    # every received row fills one slot, so the padding slots number slots - rows: known without a device sync
    padding_slots = torch.nonzero_static(padding, size=slots - rows).squeeze(1)
    return RowPermutation(index.clamp(min=0), inverse[:rows], padding_slots)


class _ToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: RowPermutation) -> torch.Tensor:
        ctx.perm = perm
        return x.index_select(0, perm.gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(0, ctx.perm.inverse), None


class _FromSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, perm: RowPermutation) -> torch.Tensor:
        ctx.perm = perm
        return y.index_select(0, perm.inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        perm = ctx.perm
        # the padding slots' outputs were never read: their gradients are zero (a few hundred rows to clear)
        return grad.index_select(0, perm.gather).index_fill_(0, perm.padding, 0), None


def permute(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, ep_degree: int,
            num_local_experts: int) -> tuple[torch.Size, torch.Tensor, RowPermutation, torch.Tensor]:
    """torchtitan's ``_permute`` contract: (the shape ``unpermute`` restores, the permuted rows, the
    permutation, the aligned rows per local expert)."""
    from torchtitan.models.moe import utils as moe_utils

    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    padded = x.shape[0] + num_local_experts * align
    max_len = (padded + align - 1) // align * align
    with torch.no_grad():
        permuted_indices, aligned_counts, _ = moe_utils.generate_permute_indices(
            num_tokens_per_expert, num_local_experts, ep_degree, max_len, align)
    perm = row_permutation(permuted_indices, x.shape[0])
    return x.shape, _ToSlots.apply(x, perm), perm, aligned_counts


def unpermute(out: torch.Tensor, input_shape: torch.Size, perm: RowPermutation) -> torch.Tensor:
    """torchtitan's ``_unpermute`` contract: the received rows back in their order."""
    return _FromSlots.apply(out, perm)
