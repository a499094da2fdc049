"""Kimi Delta Attention over a sequence split across the ranks of a context-parallel group.

Each rank holds its chunks of every row (``lowerings.ops.sequence_shards``). A segment (document) that crosses
a chunk boundary needs the recurrent state its earlier chunks ended with. Two implementations:

* ``fla`` (GPU): FLA 0.6.0's own context parallelism, ``chunk_kda(cp_context=build_cp_context(...))``, wrapped as
  the opaque op ``titan_kimi::kda_cp`` (forward and backward ops, like ``titan_kimi::kda``); FLA exchanges the
  states inside its kernels' wrappers.
* reference (everywhere): one pass of the reference recurrence per chunk with the value columns augmented by an
  identity, ``v -> [v | 0]`` from the initial state ``[0 | I]`` for a chunk whose first segment continues from
  before. The last segment's final state is then the affine map ``S_out = M S_in + Q`` of the unknown incoming
  state (``[Q | M]``), and the outputs of the augmented columns ``y`` give the outputs' dependence on it:
  ``o = o0 + y S_in``. The maps are all-gathered (autograd: the backward reduce-scatters their gradients back to
  the ranks that made them), every rank folds the whole chain in chunk order, and each takes its incoming
  states. Every rank builds the same graph, so every rank issues the same backward collectives.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lowerings.autocast import autocast_off
from lowerings.ops.kda import BACKENDS, _use_fla, check_shapes
from lowerings.ops.kda_reference import kda_rows_reference
from lowerings.ops.sequence_shards import (all_gather_autograd, check_layout, chunk_slots, local_positions,
                                          parts_per_rank, rank_chunks)

# Between CUDA graphs, never inside one: the op exchanges states between ranks.
_OUTSIDE_CUDA_GRAPHS = (torch._C.Tag.cudagraph_unsafe,)


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _incoming_states(maps: torch.Tensor, group: dist.ProcessGroup, layout: str, V: int) -> torch.Tensor:
    """``maps [B,P,H,K,V+K]`` (this rank's ``[Q | M]`` per part) -> the state entering each local part
    ``[B,P,H,K,V]`` (zeros before the first chunk), folded over the chain of every rank's parts."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, P = maps.shape[:2]
    gathered = all_gather_autograd(maps, group)  # [W*B, P, H, K, V+K]
    chain = gathered.view(world, B, P, *maps.shape[2:]).transpose(0, 1).reshape(B, world * P, *maps.shape[2:])
    chain = chain[:, chunk_slots(layout, world)]  # [B, chunks, H, K, V+K] in sequence order
    state = maps.new_zeros(B, *maps.shape[2:4], V)
    before = []
    for c in range(chain.shape[1]):
        before.append(state)
        state = chain[:, c, ..., V:] @ state + chain[:, c, ..., :V]
    return torch.stack(before, dim=1)[:, list(rank_chunks(layout, rank, world))]


def kda_context_parallel_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None, l2norm_qk: bool,
    seg_start: torch.Tensor, group: dist.ProcessGroup, layout: str,
) -> torch.Tensor:
    """The reference state passing (module docstring); plain autograd, runs on any device."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, L, H, K = q.shape
    V = v.shape[-1]
    P = parts_per_rank(layout)
    Lp = L // P
    part_start = local_positions(layout, rank, world, L * world, device=q.device).view(P, Lp)[:, :1]
    local_start = seg_start.view(B, P, Lp).long() - part_start  # < 0: the segment began in an earlier chunk
    continues = local_start[:, :, 0] < 0  # [B, P]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(B * P, Lp, *t.shape[2:])

    init = q.new_zeros(B * P, H, K, V + K, dtype=torch.float32)
    init[..., V:] = torch.eye(K, device=q.device) * continues.view(B * P, 1, 1, 1)
    o_aug, final = kda_rows_reference(
        rows(q), rows(k), torch.cat([rows(v), rows(v).new_zeros(B * P, Lp, H, K)], dim=-1), rows(g), rows(beta),
        A_log, dt_bias, lower_bound, scale, local_start.clamp(min=-1).view(B * P, Lp), init, l2norm_qk)
    s_in = _incoming_states(final.view(B, P, H, K, V + K), group, layout, V)
    s_in = s_in * continues.view(B, P, 1, 1, 1)
    o0, y = o_aug.split([V, K], dim=-1)
    o = o0 + torch.einsum("nthk,nhkv->nthv", y, s_in.reshape(B * P, H, K, V))
    return o.reshape(B, L, H, V).to(v.dtype)


# ---------------------------------------------------------------- the fla backend as opaque ops
def _fla_residual_shapes(q: torch.Tensor, v: torch.Tensor, layout: str):
    from lowerings.kernels.fla_kda import residual_shapes

    B, _, H, K = q.shape
    return [*residual_shapes(q), ((B, parts_per_rank(layout), H, K, v.shape[-1]), torch.float32)]


@torch.library.custom_op("titan_kimi::kda_cp", mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def kda_cp_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    scale: float,
    cu_seqlens: torch.Tensor,
    group_name: str,
    layout: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from lowerings.kernels.fla_kda_cp import fla_kda_cp_forward

    with autocast_off(q):  # the op sets its own precision
        return fla_kda_cp_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens,
                                  _group(group_name), layout)


@kda_cp_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, group_name, layout):
    return torch.empty_like(v), [q.new_empty(shape, dtype=dtype) for shape, dtype in _fla_residual_shapes(q, v, layout)]


@torch.library.custom_op("titan_kimi::kda_cp_backward", mutates_args=(), tags=_OUTSIDE_CUDA_GRAPHS)
def kda_cp_backward_op(
    d_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    scale: float,
    cu_seqlens: torch.Tensor,
    group_name: str,
    layout: str,
    residuals: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Gradients for (q, k, v, g, beta, A_log) and dt_bias when present."""
    from lowerings.kernels.fla_kda_cp import fla_kda_cp_backward

    with autocast_off(q):
        return fla_kda_cp_backward(d_o, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens,
                                   _group(group_name), layout, residuals)


@kda_cp_backward_op.register_fake
def _(d_o, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, group_name, layout, residuals):
    return [torch.empty_like(x) for x in (q, k, v, g, beta, A_log, dt_bias) if x is not None]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, group_name, layout = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, *output[1])
    ctx.static = (lower_bound, scale, group_name, layout)


def _backward(ctx, d_o, _d_residuals):
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, *residuals = ctx.saved_tensors
    lower_bound, scale, group_name, layout = ctx.static
    grads = kda_cp_backward_op(d_o.contiguous(), q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens,
                               group_name, layout, residuals)
    ddt = grads[6] if dt_bias is not None else None
    return (*grads[:6], ddt, None, None, None, None, None)


torch.library.register_autograd("titan_kimi::kda_cp", _backward, setup_context=_setup_context)


def kda_context_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    seg_start: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
    layout: str,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = True,
) -> torch.Tensor:
    """KDA of this rank's share of ``B`` rows split over ``group`` by ``layout``; returns ``o [B,L,H,V]``.

    ``q, k, g [B,L,H,K]``, ``v [B,L,H,V]``, ``beta [B,L,H]`` are the rank's tokens in local order. The segments
    are given twice, for the two backends: ``seg_start [B,L]``, each local token's segment start as a global
    position in its row, and ``cu_seqlens [N+1]`` (int32), the global segments over the ``B * L * world`` tokens
    of the whole batch, rows one after the other (every row start is a segment start).
    """
    check_layout(layout)
    world = dist.get_world_size(group)
    B, L = q.shape[:2]
    if L % parts_per_rank(layout) or seg_start.shape != (B, L):
        raise ValueError(f"kda_context_parallel: {L} local tokens per row and seg_start {tuple(seg_start.shape)}; "
                         f"expected [B={B}, L={L}] with L a multiple of {parts_per_rank(layout)} ({layout})")
    check_shapes("kda_context_parallel", q, k, v, g, beta)
    if _use_fla(q):
        if A_log is None or not l2norm_qk:
            raise ValueError("the fla kda backend runs the K3 configuration (l2norm_qk=True, gate from A_log)")
        if int(cu_seqlens.shape[0]) < 2:
            raise ValueError(f"kda_context_parallel: cu_seqlens needs >= 2 entries for {B * L * world} tokens")
        o, _ = kda_cp_op(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens.to(torch.int32),
                         group.group_name, layout)
        return o
    # Not a custom op, but the same fp32 recurrence as kda's reference, which sets its own precision: autocast
    # would run its matmuls in bf16.
    with autocast_off(q):
        return kda_context_parallel_reference(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                              lower_bound=lower_bound, l2norm_qk=l2norm_qk, seg_start=seg_start,
                                              group=group, layout=layout)


__all__ = ["BACKENDS", "kda_context_parallel", "kda_context_parallel_reference"]
