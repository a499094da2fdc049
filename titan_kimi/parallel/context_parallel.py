"""Context parallelism: the ranks of a CP group split every row of their (shared) batch along the sequence.

The trainer builds one ``ContextParallel`` from ``parallelism.context_parallel_degree`` (the layout's ``cp``)
and the CP mesh, and passes it to every forward as ``context_parallel=`` (the model's ``SequenceSharding``;
pipeline stages get it from ``PipelineStageModule``). The model's ``build_sequence`` hands it the batch, so each
forward describes this rank's share of the tokens (global positions and segment starts) and carries a
``ContextExchange``, through which the layers reach the rest of the sequence:

* KDA: the short convolutions' W-1 rows before each local piece (``previous_rows``, an all-gather of every
  piece's tail) and the recurrent state of the earlier pieces (``lowerings.ops.kda_cp``: FLA's ``cp_context``
  on GPU, the project's reference state passing elsewhere);
* gated MLA and the K3.1 DSA: the compressed latent ``[c_kv | k_rope]`` and the indexer keys of the whole row
  (``gather``); queries stay local at their global positions.

AttnRes and the MoE are per token and need nothing. The train step keeps each rank's tokens and labels
(``shard_batch``) and hands the model the whole rows' ``doc_ids``. Layouts: ``lowerings.ops.sequence_shards``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowerings.ops.kda_cp import kda_context_parallel
from lowerings.ops.sequence_shards import (all_gather_autograd, chunk_slots, local_positions, parts_per_rank,
                                          rank_chunks)
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, build_sequence_info

WHOLE_ROW_KEYS = ("doc_ids",)  # batch entries every CP rank keeps whole: the model needs the whole rows' segments


class ContextParallel:
    """This rank's place in its context-parallel group. ``group=None`` with ``rank`` and ``world`` describes a
    rank without communicating (planning and benchmarks, which supply their own exchange)."""

    def __init__(self, group: dist.ProcessGroup | None, layout: str, *, rank: int | None = None,
                 world: int | None = None) -> None:
        self.group, self.layout = group, layout
        if group is not None:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        elif rank is None or world is None:
            raise ValueError("ContextParallel without a process group needs rank and world")
        self.rank, self.world = rank, world
        self.parts = parts_per_rank(layout)
        self.chunks = rank_chunks(layout, self.rank, self.world)

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens in a row of ``seq_len`` tokens."""
        return local_positions(self.layout, self.rank, self.world, seq_len, device=device)

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens (and labels) of every row; ``doc_ids`` stay whole."""
        pos = self.positions(batch["input_ids"].shape[1], device=batch["input_ids"].device)
        return {k: v if k in WHOLE_ROW_KEYS else v[:, pos] for k, v in batch.items()}

    def build_sequence(self, batch: int, seq_len: int, device: torch.device,
                       doc_ids: torch.Tensor | None) -> SequenceInfo:
        """``SequenceSharding.build_sequence``: ``seq_len`` local tokens per row, ``doc_ids [batch, whole row]``."""
        total = seq_len * self.world
        if doc_ids is None:
            doc_ids = torch.ones(batch, total, dtype=torch.int32, device=device)
        if doc_ids.shape != (batch, total):
            raise ValueError(
                f"context parallelism over {self.world} ranks: doc_ids must cover the whole rows, [{batch}, "
                f"{total}] for {seq_len} local tokens per row; got {tuple(doc_ids.shape)}")
        # FLA's context-parallel KDA takes the segments as they are (no zero-length tail)
        whole = build_sequence_info(batch, total, device, doc_ids, pad_segments=False)
        pos = self.positions(total, device=device)
        seg_start = whole.seg_start[:, pos]
        rows = (torch.arange(batch, device=device, dtype=torch.int32) * total).unsqueeze(1)
        exchange = ContextExchange(self, seg_start, whole.cu_seqlens, total)
        return SequenceInfo(batch, seq_len, flat_seg_start=(seg_start + rows).reshape(-1), seg_start=seg_start,
                            pos_in_seg=whole.pos_in_seg[:, pos], cu_seqlens=whole.cu_seqlens,
                            positions=pos.expand(batch, -1), exchange=exchange,
                            is_real=(doc_ids[:, pos] != 0).reshape(-1))


class ContextExchange:
    """``titan_kimi.models.kimi_k3.sequence.SequenceExchange`` for one forward over a CP group.

    Every method runs the same collectives on every rank of the group (and, under autograd, the same backward
    ones): ranks whose answer is zeros still take part, masked, so that gloo and NCCL never see mismatched
    collectives.
    """

    def __init__(self, cp: ContextParallel, seg_start: torch.Tensor, cu_seqlens: torch.Tensor, global_len: int):
        self.cp, self.seg_start, self.cu_seqlens, self.global_len = cp, seg_start, cu_seqlens, global_len
        piece = global_len // (cp.world * cp.parts)
        self.part_starts = tuple(c * piece for c in cp.chunks)

    def _all_pieces(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, P, ...]`` (this rank's pieces) -> ``[B, chunks, ...]`` every rank's, in sequence order."""
        cp = self.cp
        gathered = all_gather_autograd(x, cp.group)
        slots = gathered.view(cp.world, *x.shape).transpose(0, 1).reshape(x.shape[0], cp.world * cp.parts,
                                                                        *x.shape[2:])
        order = chunk_slots(cp.layout, cp.world)
        return slots if order == sorted(order) else slots[:, order]

    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        cp = self.cp
        B, S, C = x.shape
        piece = S // cp.parts
        if piece < n:
            raise ValueError(f"context parallelism: pieces of {piece} tokens are shorter than the {n} rows a "
                             f"short convolution reads before them; valid: longer sequences or fewer ranks")
        every = self._all_pieces(x.view(B, cp.parts, piece, C)[:, :, piece - n:])  # [B, chunks, n, C]
        before = [c - 1 if c > 0 else 0 for c in cp.chunks]
        first = torch.tensor([c > 0 for c in cp.chunks], dtype=x.dtype, device=x.device)
        return every[:, before] * first.view(1, cp.parts, 1, 1)  # the sequence's first piece has no rows before

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        cp = self.cp
        B, S = x.shape[:2]
        every = self._all_pieces(x.view(B, cp.parts, S // cp.parts, *x.shape[2:]))
        return every.reshape(B, self.global_len, *x.shape[2:])

    def kda(self, q, k, v, g, beta, *, scale, A_log, dt_bias, lower_bound, l2norm_qk) -> torch.Tensor:
        return kda_context_parallel(q, k, v, g, beta, scale=scale, seg_start=self.seg_start,
                                    cu_seqlens=self.cu_seqlens, group=self.cp.group, layout=self.cp.layout,
                                    A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk)

