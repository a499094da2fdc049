"""The MoE's row movement around the routed experts: ``dispatch_rows`` (each token's latent row copied to its
``k`` places in expert order) and ``combine_rows`` (each token's ``k`` expert outputs, weighted and summed in
fp32), both on one ``route_rows(order, k)``. ``order`` is the stable argsort of the flat ``[T * k]`` expert
choices: expert-ordered row ``i`` belongs to token ``order[i] // k``, choice ``order[i] % k``.

Backends (op ``routed_combine``): ``reference`` is the plain torch indexing the model always had (a gather
whose gradient is an accumulating ``index_put``; an unsorting scatter, an fp32 copy, a product and a sum);
``triton`` runs the custom ops below where the MoE runs eager, whose kernels (``lowerings.kernels.routed_combine``)
gather each token's rows and sum them in one pass, forward and backward. Under expert parallelism this glue runs
eager between the all-to-alls, where nothing else fuses it; where the MoE compiles whole (no expert parallelism)
both backends trace the plain indexing for Inductor to fuse.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lowerings.ops.registry import cuda_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("routed_combine")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def _fused(t: torch.Tensor) -> bool:
    # Inside a compiled region the plain indexing stays: Inductor fuses it with its neighbours (k3_small on one
    # H100, reduce-overhead: 34,190 tokens/s with it, 33,940 with the opaque ops; docs/perf.md).
    return selected_backend("routed_combine") == "triton" and on_cuda(t) and not torch.compiler.is_compiling()


def routing_slots(order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``slots [T, k]``: where each (token, choice) pair's row sits in expert order (the inverse of ``order``)."""
    positions = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, positions).view(-1, top_k)


class RowRouting(NamedTuple):
    """One MoE forward's routing, shared by its dispatch and combine: ``order`` and ``top_k`` as above, and
    ``slots`` (``routing_slots``) when the fused ops run, else None."""

    order: torch.Tensor
    top_k: int
    slots: torch.Tensor | None


def route_rows(order: torch.Tensor, top_k: int) -> RowRouting:
    """The routing for ``dispatch_rows`` and ``combine_rows``: the slots are computed once, where the fused ops
    will read them."""
    return RowRouting(order, top_k, routing_slots(order, top_k) if _fused(order) else None)


def dispatch_rows(x: torch.Tensor, routing: RowRouting) -> torch.Tensor:
    """``x [T, L]`` -> ``[T * k, L]``: row ``i`` is ``x[order[i] // k]``."""
    order, top_k, slots = routing
    if order.shape[0] != x.shape[0] * top_k:
        raise ValueError(f"dispatch_rows: order has {order.shape[0]} entries, expected T * k = "
                         f"{x.shape[0]} * {top_k}")
    if slots is None:
        return x[order // top_k]
    return routed_dispatch_op(x, order, slots, top_k)


def dispatch_present(x: torch.Tensor, routing: RowRouting, present: int) -> torch.Tensor:
    """``dispatch_rows``' first ``present`` rows: where choices absent from this rank sort after the present ones
    (a relay of the hierarchical dispatch), only those are made; a token's gradient sums its present rows'."""
    order, top_k, slots = routing
    if order.shape[0] != x.shape[0] * top_k or not 0 <= present <= order.shape[0]:
        raise ValueError(f"dispatch_present: order has {order.shape[0]} entries, expected T * k = "
                         f"{x.shape[0]} * {top_k}, and {present} present rows of them")
    if slots is None:
        return x.index_select(0, order[:present] // top_k)
    return routed_dispatch_op(x, order[:present], slots, top_k)


def combine_present(rows: torch.Tensor, routing: RowRouting, weights: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``combine_rows`` of the first ``N = rows.shape[0]`` expert-ordered rows, the absent choices' (past them)
    counting zero: ``[T, L]`` in ``dtype``, summed in fp32."""
    order, _, slots = routing
    T, k = weights.shape
    if rows.shape[0] > T * k or order.shape[0] != T * k:
        raise ValueError(f"combine_present: {rows.shape[0]} rows and {order.shape[0]} order entries, expected at "
                         f"most and exactly T * k = {T} * {k} (weights {tuple(weights.shape)})")
    if slots is None:  # each present row weighted, added into its token in fp32 (T * k rows would not fit)
        present = order[:rows.shape[0]]
        weighted = rows.float() * weights.reshape(-1).index_select(0, present).unsqueeze(1)
        return weighted.new_zeros(T, rows.shape[1]).index_add(0, present // k, weighted).to(dtype)
    return routed_gather_sum_op(rows, slots, weights, dtype)


def sum_present(rows: torch.Tensor, owner: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, L]`` in ``dtype``: each of ``T = slots.shape[0]`` outputs sums (in fp32) its rows: row ``i`` belongs
    to output ``owner[i]``, and ``slots [T, K]`` lists each output's rows (a slot at or past ``rows.shape[0]``
    names none; every row is listed once). The hierarchical dispatch's sum of a token's (token, node) pairs."""
    if _fused(rows):
        return routed_gather_sum_op(rows, slots, None, dtype)
    total = rows.new_zeros(slots.shape[0], rows.shape[1], dtype=torch.float32)
    return total.index_add(0, owner, rows.float()).to(dtype)


def combine_rows(rows: torch.Tensor, routing: RowRouting, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert-ordered ``rows [T * k, L]`` -> ``[T, L]`` in ``dtype``: ``sum_j weights[t, j] row(t, j)`` in fp32."""
    order, _, slots = routing
    T, k = weights.shape
    if rows.shape[0] != T * k or order.shape[0] != T * k:
        raise ValueError(f"combine_rows: {rows.shape[0]} rows and {order.shape[0]} order entries, expected "
                         f"T * k = {T} * {k} (weights {tuple(weights.shape)})")
    if slots is None:
        unsorted = torch.empty_like(rows)
        unsorted[order] = rows
        return (weights.unsqueeze(-1) * unsorted.view(T, k, -1).float()).sum(1).to(dtype)
    return routed_gather_sum_op(rows, slots, weights, dtype)


# ------------------------------------------------------------------------------------------- the custom ops

def _with_absent_row(rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` with one zero row appended, and ``slots`` with the absent ones (at or past the rows) pointing at it."""
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), slots.clamp(max=rows.shape[0])


def gather_sum_reference(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor:
    rows, slots = _with_absent_row(rows, slots)
    gathered = rows[slots].float()  # [T, k, L]
    if weights is not None:
        gathered = weights.unsqueeze(-1).float() * gathered
    return gathered.sum(1).to(dtype)


def gather_sum_backward_reference(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                                  weights: torch.Tensor) -> list[torch.Tensor]:
    g = grad.float().unsqueeze(1)  # [T, 1, L]
    padded, slots = _with_absent_row(rows, slots)
    d_rows = torch.empty_like(padded)
    d_rows[slots.reshape(-1)] = (weights.float().unsqueeze(-1) * g).to(rows.dtype).flatten(0, 1)
    return [d_rows[:-1], (g * padded[slots].float()).sum(-1)]


@torch.library.custom_op("titan_kimi::routed_gather_sum", mutates_args=())
def routed_gather_sum_op(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor:
    if rows.is_cuda:
        from lowerings.kernels.routed_combine import gather_sum

        return gather_sum(rows, slots, weights, dtype)
    return gather_sum_reference(rows, slots, weights, dtype)


@routed_gather_sum_op.register_fake
def _(rows, slots, weights, dtype):
    return rows.new_empty((slots.shape[0], rows.shape[1]), dtype=dtype)


@torch.library.custom_op("titan_kimi::routed_gather_sum_backward", mutates_args=())
def routed_gather_sum_backward_op(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                                  weights: torch.Tensor) -> list[torch.Tensor]:
    """``[d_rows, d_weights (fp32)]`` of the weighted gather-sum."""
    if rows.is_cuda:
        from lowerings.kernels.routed_combine import gather_sum_backward

        return list(gather_sum_backward(grad, rows, slots, weights))
    return gather_sum_backward_reference(grad, rows, slots, weights)


@routed_gather_sum_backward_op.register_fake
def _(grad, rows, slots, weights):
    return [torch.empty_like(rows), weights.new_empty(weights.shape, dtype=torch.float32)]


def _gather_sum_setup(ctx, inputs, output):
    rows, slots, weights, _ = inputs
    ctx.save_for_backward(rows, slots, weights)
    ctx.weights_dtype = None if weights is None else weights.dtype


def _gather_sum_backward(ctx, grad):
    rows, slots, weights = ctx.saved_tensors
    unit = weights is None  # the dispatch's gradient: only its own gradient (a double backward) lands here
    w = torch.ones(slots.shape, dtype=torch.float32, device=rows.device) if unit else weights
    d_rows, d_weights = routed_gather_sum_backward_op(grad.contiguous(), rows, slots, w)
    return d_rows, None, None if unit else d_weights.to(ctx.weights_dtype), None


torch.library.register_autograd("titan_kimi::routed_gather_sum", _gather_sum_backward, setup_context=_gather_sum_setup)


@torch.library.custom_op("titan_kimi::routed_dispatch", mutates_args=())
def routed_dispatch_op(x: torch.Tensor, order: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x[order // top_k]``; its gradient sums each token's rows at ``slots`` (an unweighted gather-sum)."""
    return x[order // top_k]  # advanced indexing: torch's vectorized gather, faster here than index_select


@routed_dispatch_op.register_fake
def _(x, order, slots, top_k):
    return x.new_empty((order.shape[0], x.shape[1]))


def _dispatch_setup(ctx, inputs, output):
    x, _, slots, _ = inputs
    ctx.save_for_backward(slots)
    ctx.x_dtype = x.dtype


def _dispatch_backward(ctx, grad):
    (slots,) = ctx.saved_tensors
    return routed_gather_sum_op(grad.contiguous(), slots, None, ctx.x_dtype), None, None, None


torch.library.register_autograd("titan_kimi::routed_dispatch", _dispatch_backward, setup_context=_dispatch_setup)
