"""Per-batch document structure, computed once per forward outside the compiled blocks.

``doc_ids [B,S]`` (0 = padding, 1.. = documents) becomes segments: runs of equal id within a row, padding
runs included. Segments tile the batch, so KDA resets its state and conv window at every segment start and
attention stays inside a segment: padding never influences real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo


@dataclass
class SequenceInfo:
    batch: int
    seq_len: int
    flat_seg_start: torch.Tensor  # [B*S] int32: flat index of each token's segment start
    seg_start: torch.Tensor | None = None  # [B,S] int32 row-local segment start; None = one sequence per row
    pos_in_seg: torch.Tensor | None = None  # [B,S] int32 position inside the segment
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32 over the flattened tokens

    @property
    def packed(self) -> bool:
        return self.seg_start is not None


def build_sequence_info(batch: int, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None = None) -> SequenceInfo:
    """Segment metadata for a ``[batch, seq_len]`` batch; ``doc_ids`` None means one document per row."""
    pos = torch.arange(seq_len, device=device, dtype=torch.int32)
    row_offset = (torch.arange(batch, device=device, dtype=torch.int32) * seq_len).unsqueeze(1)
    if doc_ids is None:
        return SequenceInfo(batch, seq_len, (row_offset + torch.zeros_like(pos)).expand(batch, seq_len).reshape(-1))
    if doc_ids.shape != (batch, seq_len):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}, expected {(batch, seq_len)}")
    is_start = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Row-local start of each token's segment: running max of the start positions seen so far.
    starts = torch.where(is_start, pos.expand(batch, seq_len), torch.zeros_like(pos))
    seg_start = torch.cummax(starts, dim=1).values.to(torch.int32)
    flat_starts = (is_start.reshape(-1)).nonzero().squeeze(1).to(torch.int32)
    cu_seqlens = torch.cat([flat_starts, flat_starts.new_tensor([batch * seq_len])])
    # The document count changes from batch to batch: compiled blocks treat its length as dynamic up front
    # instead of recompiling every block once when it first changes.
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return SequenceInfo(
        batch,
        seq_len,
        flat_seg_start=(seg_start + row_offset).reshape(-1),
        seg_start=seg_start,
        pos_in_seg=pos - seg_start,
        cu_seqlens=cu_seqlens,
    )
