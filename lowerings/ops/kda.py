"""``titan_kimi::kda``: the chunked gated delta rule as an opaque custom op with autograd.

FLA disables dynamo on its KDA entry points on purpose, so the op boundary is what keeps a compiled KDA
block in one graph. Forward and backward are separate ops whose bodies dispatch to the selected backend.
The forward also returns the backend's residuals (what its backward needs besides the inputs): none for the
reference, which recomputes, FLA's saved intermediates for ``fla``, none for ``cudnn`` (its preprocessing is
recomputed, lowerings/kernels/cudnn_kda.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from lowerings.autocast import autocast_off
from lowerings.ops.kda_reference import kda_reference
from lowerings.ops.registry import (all_of, cuda_available, module_available, on_cuda, op_backends,
                                    selected_backend)

BACKENDS = op_backends("kda")
BACKENDS.add("fla", all_of(cuda_available, module_available("fla")), auto_rank=0)


def _cudnn_available() -> str | None:  # CUDA, sm90, the cuDNN frontend's Hopper engine, cuda.bindings, NVRTC, headers
    from lowerings.kernels.cudnn_kda import unavailable_reason

    return unavailable_reason()


# Refused at config time until its GPU gradient test passes (lowerings/kernels/cudnn_kda.NUMERICS_VALIDATED); no
# auto_rank. Measured on the H200 at T=2,048, 16 heads, 20 documents: fwd+bwd 4.15 ms against fla's 5.44 ms.
BACKENDS.add("cudnn", _cudnn_available)

_EMPTY = (0,)


def _use_fla(q: torch.Tensor) -> bool:
    return selected_backend("kda") == "fla" and on_cuda(q)


def _use_cudnn(q: torch.Tensor) -> bool:
    return selected_backend("kda") == "cudnn" and on_cuda(q)


def _num_sequences(q: torch.Tensor, cu_seqlens: torch.Tensor | None):
    return cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]


def _final_state_shape(q, v, cu_seqlens, output_final_state):
    return (_num_sequences(q, cu_seqlens), *q.shape[2:], v.shape[-1]) if output_final_state else _EMPTY


def _differentiable_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state):
    return [x for x in (q, k, v, g, beta, A_log, dt_bias, initial_state) if x is not None]


def check_shapes(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, expected: str = "") -> None:
    """ValueError naming ``what`` unless q = k = g = [B,T,H,K], v = [B,T,H,V], beta = [B,T,H]: the contract of
    ``kda`` and of its context-parallel form (lowerings/ops/kda_cp.py)."""
    if q.shape != k.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"{what} shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}{expected}")


def _reference_backward(
    d_o, d_final, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state, output_final_state, l2norm_qk
):
    present = [x is not None for x in (A_log, dt_bias, initial_state)]

    def forward(q, k, v, g, beta, *optional):
        it = iter(optional)
        a, d, s = (next(it) if p else None for p in present)
        return kda_reference(q, k, v, g, beta, a, d, lower_bound, scale, cu_seqlens, s, output_final_state, l2norm_qk)

    inputs = _differentiable_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state)
    with torch.enable_grad():
        _, vjp = torch.func.vjp(forward, *inputs)
    return [x.contiguous() for x in vjp((d_o, d_final))]


# Inside CUDA graphs: the fla backend runs FLA's graph mode (chunk indices built on the device, no host sync:
# lowerings/kernels/fla_kda.py) with fresh buffers per call (lowerings/kernels/fla_graph_buffers.py: FLA's
# process-wide graph buffers were the 12 tensors cudagraph trees found left in their pool, one per KDA layer).
# The context-parallel op (lowerings/ops/kda_cp.py) exchanges states between ranks and stays outside them.


@torch.library.custom_op("titan_kimi::kda", mutates_args=())
def kda_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    args = (q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state, output_final_state, l2norm_qk)
    with autocast_off(q):  # the op sets its own precision (the reference: fp32)
        if _use_fla(q):
            from lowerings.kernels.fla_kda import fla_kda_forward

            return fla_kda_forward(*args)
        if _use_cudnn(q):
            from lowerings.kernels.cudnn_kda import cudnn_kda_forward

            return cudnn_kda_forward(*args)
        o, final = kda_reference(*args)
        return o, final, []


@kda_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state, output_final_state, l2norm_qk):
    final = q.new_empty(_final_state_shape(q, v, cu_seqlens, output_final_state), dtype=torch.float32)
    residuals = []
    if _use_fla(q):
        from lowerings.kernels.fla_kda import residual_shapes

        residuals = [q.new_empty(shape, dtype=dtype) for shape, dtype in residual_shapes(q)]
    elif _use_cudnn(q):
        from lowerings.kernels.cudnn_kda import check_supported, residual_shapes

        check_supported(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state,
                        output_final_state, l2norm_qk)  # at trace time: what the kernels cannot run fails here
        residuals = [q.new_empty(shape, dtype=dtype) for shape, dtype in residual_shapes(q)]
    return torch.empty_like(v), final, residuals


@torch.library.custom_op("titan_kimi::kda_backward", mutates_args=())
def kda_backward_op(
    d_o: torch.Tensor,
    d_final: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    l2norm_qk: bool,
    residuals: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Gradients for (q, k, v, g, beta) followed by those of the optional inputs that are present."""
    args = (d_o, d_final, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state,
            output_final_state, l2norm_qk)
    with autocast_off(q):
        if _use_fla(q):
            from lowerings.kernels.fla_kda import fla_kda_backward

            return fla_kda_backward(*args, residuals)
        if _use_cudnn(q):
            from lowerings.kernels.cudnn_kda import cudnn_kda_backward

            return cudnn_kda_backward(*args, residuals)
        return _reference_backward(*args)


@kda_backward_op.register_fake
def _(d_o, d_final, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state,
      output_final_state, l2norm_qk, residuals):
    return [torch.empty_like(x) for x in _differentiable_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state)]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state, output_final_state, l2norm_qk = inputs
    _, _, residuals = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, *residuals)
    ctx.static = (lower_bound, scale, output_final_state, l2norm_qk)


def _backward(ctx, d_o, d_final, _d_residuals):
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, initial_state, *residuals = ctx.saved_tensors
    lower_bound, scale, output_final_state, l2norm_qk = ctx.static
    if d_o is None:
        d_o = torch.zeros_like(v)
    if d_final is None:
        d_final = torch.zeros(_final_state_shape(q, v, cu_seqlens, output_final_state), dtype=torch.float32,
                              device=q.device)
    grads = iter(kda_backward_op(d_o, d_final, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens,
                                 initial_state, output_final_state, l2norm_qk, residuals))
    dq, dk, dv, dg, dbeta = (next(grads) for _ in range(5))
    dA = next(grads) if A_log is not None else None
    ddt = next(grads) if dt_bias is not None else None
    ds = next(grads) if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dA, ddt, None, None, None, ds, None, None


torch.library.register_autograd("titan_kimi::kda", _backward, setup_context=_setup_context)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    l2norm_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention; see docs/ops.md. Returns (o, final_state or None)."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"kda with cu_seqlens needs batch 1 (packed tokens), got q of shape {tuple(q.shape)}")
    check_shapes("kda", q, k, v, g, beta, expected="; expected q = k = g = [B,T,H,K], v = [B,T,H,V], beta = [B,T,H]")
    o, final, _ = kda_op(
        q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state, output_final_state, l2norm_qk
    )
    return o, (final if output_final_state else None)
