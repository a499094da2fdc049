"""How a sequence is split over the ranks of a context-parallel group (shared by the context-parallel ops and
by the training code that slices batches).

Every row of ``S`` tokens is cut into equal chunks. ``contiguous``: ``world`` chunks, rank r holds chunk r.
``zigzag``: ``2 * world`` chunks, rank r holds chunks r and 2 * world - 1 - r, so that causal attention, whose
cost grows along the sequence, costs every rank the same. A rank's local row is its chunks in increasing order
(its "parts"), which is also FLA's zigzag buffer order (``fla.ops.cp.build_cp_context(layout="zigzag")``).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout {layout!r}; valid: {list(LAYOUTS)}")


def parts_per_rank(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def num_chunks(layout: str, world: int) -> int:
    return parts_per_rank(layout) * world


def rank_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds, in local order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a context-parallel group of {world}")
    return (rank, 2 * world - 1 - rank) if parts_per_rank(layout) == 2 else (rank,)


def chunk_slots(layout: str, world: int) -> list[int]:
    """For each global chunk, its slot ``rank * parts + part`` in a rank-major all-gather of every rank's parts."""
    parts = parts_per_rank(layout)
    slots = [0] * num_chunks(layout, world)
    for rank in range(world):
        for part, chunk in enumerate(rank_chunks(layout, rank, world)):
            slots[chunk] = rank * parts + part
    return slots


def local_positions(layout: str, rank: int, world: int, seq_len: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_len // world]`` (int64) of the tokens rank ``rank`` holds, in local order."""
    chunks = num_chunks(layout, world)
    if seq_len % chunks:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into {chunks} equal chunks ({layout} "
                         f"layout over {world} ranks); valid: a multiple of {chunks}")
    length = seq_len // chunks
    return torch.cat([torch.arange(c * length, (c + 1) * length, device=device)
                      for c in rank_chunks(layout, rank, world)])


def all_gather_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, rank by rank; the backward reduce-scatters the gradients."""
    # torch 2.13 renamed the autograd all-gather (the old name warns); the GPU machines run torch 2.11
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x.contiguous(), gather_dim=0, group=group)
