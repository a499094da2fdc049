"""The expert-parallel rank's row permutation (received rows grouped by local expert, each group padded to the
grouped GEMM's alignment, and back) as two row gathers, forward and backward.

torchtitan's ``_permute`` appends a zero row (a copy of every received row), gathers with advanced indexing
(whose backward is a sort-based accumulating ``index_put``) and ``_unpermute`` scatters back with ``index_put``
(an element-wise indexing kernel). Every received row sits at exactly one place of the permuted order, so both
directions are gathers once the inverse positions are known (on one H100 at k31.toml's 65,536 received rows x
3,584, the MoE FFN's forward copy and index kernels went from 4.70 to 3.61 ms; docs/perf.md). Padding slots
(index -1) read a copy of a real row instead of zeros: their outputs are never read and their output gradients
are zero, so the experts' weight gradients are the same.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torchtitan.models.moe import utils as moe_utils
from torchtitan.tools.utils import _round_up


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


class _RowGather(torch.autograd.Function):
    """``x.index_select(0, index)`` whose gradient is the gather back by ``back`` (the inverse positions), rows
    ``clear`` (the padding slots, whose outputs nothing read) set to zero."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor, clear: torch.Tensor | None):
        ctx.back, ctx.clear = back, clear
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.index_select(0, ctx.back)
        return (out if ctx.clear is None else out.index_fill_(0, ctx.clear, 0)), None, None, None


def permute(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, ep_degree: int,
            num_local_experts: int) -> tuple[torch.Size, torch.Tensor, RowPermutation, torch.Tensor]:
    """torchtitan's ``_permute`` contract: (the shape ``unpermute`` restores, the permuted rows, the
    permutation, the aligned rows per local expert)."""
    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M  # read per call: torchtitan sets it per dtype
    max_len = _round_up(x.shape[0] + num_local_experts * align, align)  # torchtitan's room for the padding
    with torch.no_grad():
        permuted_indices, aligned_counts, _ = moe_utils.generate_permute_indices(
            num_tokens_per_expert, num_local_experts, ep_degree, max_len, align)
    perm = row_permutation(permuted_indices, x.shape[0])
    return x.shape, _RowGather.apply(x, perm.gather, perm.inverse, None), perm, aligned_counts


def unpermute(out: torch.Tensor, input_shape: torch.Size, perm: RowPermutation) -> torch.Tensor:
    """torchtitan's ``_unpermute`` contract: the received rows back in their order."""
    return _RowGather.apply(out, perm.inverse, perm.gather, perm.padding)
