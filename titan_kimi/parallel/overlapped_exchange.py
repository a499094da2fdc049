"""An all-to-all with independent work queued while it is in flight, in forward and in backward.

``all_to_all_alongside(x, ...)`` issues the exchange of ``x``, runs ``alongside()`` (work that does not read the
exchanged rows: the MoE's shared experts), then waits. On a GPU the exchange runs on the communicator's stream
and the alongside work on the compute stream, so they overlap. Backward mirrors it: the reverse exchange of the
gradient is issued, the alongside work's backward runs, then the wait. Values and gradients equal
``all_to_all_single_autograd(x, ...)`` with ``alongside()`` called beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# The raw functional ops: torch's Python wrapper returns a lazily waited tensor in eager and waits at once when
# traced, while the point here is to choose where the wait goes. ``wait_tensor`` also serves the node-level
# dispatch's unwaited exchanges.
_all_to_all = torch.ops._c10d_functional.all_to_all_single
wait_tensor = torch.ops._c10d_functional.wait_tensor


class _Start(torch.autograd.Function):
    """Forward: issue the exchange (no wait). Backward: wait for the reverse exchange ``_Finish`` issued.

    Besides the pending rows it returns a stand-in of ``x``'s shape (one zero broadcast to it): the reverse
    exchange has ``x``'s shape, not the pending rows', and autograd checks each gradient against its tensor's
    shape, so the gradient travels from ``_Finish`` to here as the stand-in's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        pending = _all_to_all(x, output_splits, input_splits, group_name)
        ctx.mark_non_differentiable(pending)
        ctx.set_materialize_grads(False)  # the pending rows' gradient stays None rather than a zero tensor
        return pending, x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, _: None, pending: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        return (None if pending is None else wait_tensor(pending)), None, None, None


class _Finish(torch.autograd.Function):
    """Forward: wait for the exchange ``_Start`` issued. Backward: issue the reverse exchange (no wait) and hand
    it to ``_Start`` as the stand-in's gradient."""

    @staticmethod
    def forward(ctx, pending: torch.Tensor, stand_in: torch.Tensor, output_splits: list[int],
                input_splits: list[int], group_name: str) -> torch.Tensor:
        ctx.splits, ctx.group_name = (output_splits, input_splits), group_name
        # wait_tensor hands back its input; autograd.Function returns an unchanged input as a view of it
        # (metadata only), so the output gets this node as its grad_fn.
        return wait_tensor(pending)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[None, torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return None, _all_to_all(dy.contiguous(), input_splits, output_splits, ctx.group_name), None, None, None


def all_to_all_alongside(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                         group: dist.ProcessGroup, alongside: Callable[[], Any] | None) -> tuple[torch.Tensor, Any]:
    """``all_to_all_single_autograd(x, output_splits, input_splits, group)`` and ``alongside()`` (None: nothing),
    the latter queued while the exchange is in flight; returns both results.

    Backward overlaps too, by the autograd engine's order: of the nodes ready to run it takes the one created
    last (highest sequence number) first. ``alongside``'s nodes are created between ``_Start`` and ``_Finish``,
    so after ``_Finish``'s backward issues the reverse exchange they run before ``_Start``'s backward waits.
    Nodes created before this call run after that wait, and nodes created after it before the reverse exchange
    is issued: another exchange's backward, which waits at once, stays out of the window either way.
    """
    if len(output_splits) != len(input_splits):
        raise ValueError(f"all_to_all_alongside: {len(output_splits)} output splits and {len(input_splits)} input "
                         "splits, expected one of each per rank")
    name = group.group_name
    pending, stand_in = _Start.apply(x, output_splits, input_splits, name)
    beside = alongside() if alongside is not None else None
    return _Finish.apply(pending, stand_in, output_splits, input_splits, name), beside
