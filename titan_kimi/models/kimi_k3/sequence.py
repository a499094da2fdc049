"""Per-batch document structure, computed once per forward outside the compiled blocks.

``doc_ids [B,S]`` (0 = padding, 1.. = documents) becomes segments: runs of equal id within a row, padding
runs included. Segments tile the batch, so KDA resets its state and conv window at every segment start and
attention stays inside a segment: padding never influences real tokens.

When the rows are split over ranks (context parallelism), the model's forward takes a ``SequenceSharding``
(``context_parallel=``), which builds the SequenceInfo of this rank's tokens
(``titan_kimi.parallel.context_parallel``): positions and segment starts are then global (the
whole row's), and ``exchange`` reaches the tokens other ranks hold. Layers ask it for the three things they
need from the rest of the sequence; the model itself never communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch._dynamo


class SequenceExchange(Protocol):
    """The rest of the sequence, for a rank that holds P equal pieces of every row, in local order.

    ``global_len`` is the whole row's length and ``part_starts`` the global position of each of the P pieces.
    """

    global_len: int
    part_starts: tuple[int, ...]

    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``x [B,S,C]`` -> ``[B,P,n,C]``: the n rows before each local piece in the whole row (zeros at its start)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B,S,C]`` -> ``[B,global_len,C]``: every rank's rows in sequence order (differentiable)."""
        ...

    def kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: float, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
            l2norm_qk: bool) -> torch.Tensor:
        """The ``ops.kda`` contract over ``[B,S,...]`` local rows, with the recurrent state carried in from the
        earlier pieces of each row; returns o ``[B,S,H,V]``."""
        ...


class SequenceSharding(Protocol):
    """This rank's share of every row: what the model's ``forward(context_parallel=...)`` takes under context
    parallelism (``titan_kimi.parallel.context_parallel.ContextParallel``, built from
    ``parallelism.context_parallel_degree``)."""

    def build_sequence(self, batch: int, seq_len: int, device: torch.device,
                       doc_ids: torch.Tensor | None) -> SequenceInfo:
        """The SequenceInfo of ``seq_len`` local tokens per row, from the whole rows' ``doc_ids``."""
        ...


@dataclass
class SequenceInfo:
    batch: int
    seq_len: int
    flat_seg_start: torch.Tensor  # [B*S] int32: flat index of each token's segment start
    seg_start: torch.Tensor | None = None  # [B,S] int32 row-local segment start; None = one sequence per row
    pos_in_seg: torch.Tensor | None = None  # [B,S] int32 position inside the segment
    # [N+1] int32 over the flattened tokens, padded with zero-length segments (see `segment_slots`)
    cu_seqlens: torch.Tensor | None = None
    # Context parallelism (None without): global positions [B,S] of the local tokens and the exchange. Then
    # seg_start, pos_in_seg and flat_seg_start are global (flat over the whole rows), and so is cu_seqlens.
    positions: torch.Tensor | None = None
    exchange: SequenceExchange | None = None
    # No trained query has more causal keys than the indexer's top-k: its selection would be every causal key,
    # so DSA layers attend densely instead (the model sets it from host-side facts; a bool, so compiled blocks
    # see at most two values).
    dsa_dense: bool = False
    # [B*S] bool: tokens of a document (doc id != 0), not padding; None = every token.
    is_real: torch.Tensor | None = None
    # Indexer training (index_training != "frozen"): the weight of each query's KL in the loss, a 0-dim fp32
    # tensor (the KL weight over the step's count of real queries and DSA layers); None = the mean over this
    # forward's real queries and the DSA layers.
    indexer_loss_scale: torch.Tensor | None = None
    # Measure the indexer's recall in this forward (a logging step: it costs the attention over every causal
    # key in the sparse stage); a bool, so compiled blocks see at most two values.
    indexer_metrics: bool = False

    @property
    def packed(self) -> bool:
        return self.seg_start is not None


@dataclass(frozen=True)
class QueryRun:
    """Queries ``rows`` of the flattened local tokens, all in row ``row`` of the batch (or every row: None), with
    their segment starts and the position of the first among the keys they read."""

    rows: slice
    row: int | None
    seg_start: torch.Tensor
    q_offset: int


def query_runs(seq: SequenceInfo) -> list[QueryRun]:
    """How ops that take every causal key see a batch: without context parallelism one run of all tokens against
    the flattened keys (flat segment starts keep each query inside its row and document); under context
    parallelism one run per local piece of each row, against that row's gathered keys from its global start."""
    if seq.exchange is None:
        return [QueryRun(slice(0, seq.batch * seq.seq_len), None, seq.flat_seg_start, 0)]
    S = seq.seq_len
    piece = S // len(seq.exchange.part_starts)
    return [QueryRun(slice(b * S + p * piece, b * S + (p + 1) * piece), b,
                     seq.seg_start[b, p * piece:(p + 1) * piece], start)
            for b in range(seq.batch) for p, start in enumerate(seq.exchange.part_starts)]


MIN_SEGMENT_SLOTS = 64


def segment_slots(num_segments: int) -> int:
    """How many entries (less one) ``cu_seqlens`` gets for ``num_segments`` segments: the next power of two, at
    least 64. The tail is zero-length segments. The count of documents changes from batch to batch; padded, the
    shape takes a handful of values, so a CUDA graph recorded for one batch replays for the next, and KDA
    kernels size their grids from shapes alone, never from values on the host."""
    if num_segments < 1:
        raise ValueError(f"num_segments = {num_segments}: a batch has at least one segment")
    return max(MIN_SEGMENT_SLOTS, 1 << (num_segments - 1).bit_length())


def build_sequence_info(batch: int, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None = None, *,
                        pad_segments: bool = True) -> SequenceInfo:
    """Segment metadata for a ``[batch, seq_len]`` batch; ``doc_ids`` None means one document per row.

    ``pad_segments``: pad ``cu_seqlens`` with zero-length segments to `segment_slots` entries (its last value
    repeated); off, it has exactly one entry per segment plus one."""
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
    total = batch * seq_len
    tail = segment_slots(flat_starts.shape[0]) - flat_starts.shape[0] + 1 if pad_segments else 1
    cu_seqlens = torch.cat([flat_starts, flat_starts.new_full((tail,), total)])
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
        is_real=(doc_ids != 0).reshape(-1),
    )
