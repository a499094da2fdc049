"""``titan_kimi::attn_res_mix``: the Attention-Residuals softmax mix over the block bank and the partial sum.

The opaque ``custom_op`` runs in eager and the ``default`` compile modes; ``attn_res_mix_triton`` is the same
contract as a ``torch.library.triton_op`` (kernels launched through ``wrap_triton``, visible to Inductor),
used under the ``inductor`` compile mode when the triton backend runs on CUDA.
"""

from __future__ import annotations

import torch

from lowerings.autocast import autocast_off
from lowerings.ops.registry import cuda_available, op_backends, selected_backend, triton_ops_enabled

BACKENDS = op_backends("attn_res_mix")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def _triton(partial: torch.Tensor) -> bool:
    return selected_backend("attn_res_mix") == "triton" and partial.is_cuda


def attn_res_mix_reference(
    bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """values = bank entries then partial; z_i = proj(RMSNorm_fp32(v_i)); out = sum_i softmax(z)_i v_i."""
    values, _, _, _, alpha = _mix_terms(bank, partial, norm_weight, proj_weight, eps)
    return (alpha.unsqueeze(-1) * values).sum(1).to(partial.dtype)


def _mix_terms(bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, ...]:
    """fp32 values v [N, m+1, H], gw = norm_weight * proj_weight, r = rsqrt(mean(v^2) + eps), s = v . gw and the
    softmax weights of z = s r: what the reference's forward and backward both start from."""
    values = torch.cat([bank, partial.unsqueeze(1)], dim=1).float()
    gw = norm_weight.float() * proj_weight.float()
    inv_rms = torch.rsqrt(values.pow(2).mean(-1) + eps)  # [N, m+1]
    s = values @ gw
    return values, gw, inv_rms, s, torch.softmax(s * inv_rms, dim=-1)


def attn_res_mix_reference_backward(
    grad: torch.Tensor, bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor,
    proj_weight: torch.Tensor, eps: float,
) -> list[torch.Tensor]:
    """Gradients of ``attn_res_mix_reference`` for (bank, partial, norm_weight, proj_weight), in closed form:
    with s_i = v_i . gw, r_i = rsqrt(mean(v_i^2) + eps), z_i = s_i r_i and a = softmax(z),
    dz_i = a_i (g.v_i - sum_j a_j g.v_j),  dv_i = a_i g + dz_i (r_i gw - s_i r_i^3 v_i / H),
    d(gw) = sum dz_i r_i v_i (one pass over the values instead of autograd's replay of the forward)."""
    values, gw, inv_rms, s, alpha = _mix_terms(bank, partial, norm_weight, proj_weight, eps)
    H = values.shape[-1]
    g = grad.float().unsqueeze(1)  # [N, 1, H]
    d_alpha = (values * g).sum(-1)
    dz = alpha * (d_alpha - (alpha * d_alpha).sum(-1, keepdim=True))
    d_gw = torch.einsum("nm,nmh->h", dz * inv_rms, values)
    d_values = (alpha.unsqueeze(-1) * g + (dz * inv_rms).unsqueeze(-1) * gw
                - (dz * s * inv_rms.pow(3) / H).unsqueeze(-1) * values)
    return [d_values[:, :-1].to(bank.dtype, copy=True), d_values[:, -1].to(partial.dtype, copy=True),  # no views
            (d_gw * proj_weight.float()).to(norm_weight.dtype), (d_gw * norm_weight.float()).to(proj_weight.dtype)]


@torch.library.custom_op("titan_kimi::attn_res_mix", mutates_args=())
def attn_res_mix_op(
    bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    with autocast_off(partial):  # the op sets its own precision (the reference: fp32)
        if _triton(partial):
            from lowerings.kernels.attn_res_mix import attn_res_mix_forward

            return attn_res_mix_forward(bank, partial, norm_weight, proj_weight, eps)
        return attn_res_mix_reference(bank, partial, norm_weight, proj_weight, eps)


@attn_res_mix_op.register_fake
def _(bank, partial, norm_weight, proj_weight, eps):
    return torch.empty_like(partial)


@torch.library.custom_op("titan_kimi::attn_res_mix_backward", mutates_args=())
def attn_res_mix_backward_op(
    grad: torch.Tensor,
    bank: torch.Tensor,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> list[torch.Tensor]:
    """Gradients for (bank, partial, norm_weight, proj_weight)."""
    with autocast_off(partial):
        if _triton(partial):
            from lowerings.kernels.attn_res_mix import attn_res_mix_backward

            return list(attn_res_mix_backward(grad, bank, partial, norm_weight, proj_weight, eps))
        grads = attn_res_mix_reference_backward(grad, bank, partial, norm_weight, proj_weight, eps)
        return [x.contiguous() for x in grads]


@attn_res_mix_backward_op.register_fake
def _(grad, bank, partial, norm_weight, proj_weight, eps):
    return [torch.empty_like(x) for x in (bank, partial, norm_weight, proj_weight)]


def _setup_context(ctx, inputs, output):
    bank, partial, norm_weight, proj_weight, eps = inputs
    ctx.save_for_backward(bank, partial, norm_weight, proj_weight)
    ctx.eps = eps


def _backward(ctx, grad):
    grads = attn_res_mix_backward_op(grad.contiguous(), *ctx.saved_tensors, ctx.eps)
    return (*grads, None)


torch.library.register_autograd("titan_kimi::attn_res_mix", _backward, setup_context=_setup_context)


@torch.library.triton_op("titan_kimi::attn_res_mix_triton", mutates_args=())
def attn_res_mix_triton_op(
    bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    from lowerings.kernels.attn_res_mix import attn_res_mix_forward

    return attn_res_mix_forward(bank, partial, norm_weight, proj_weight, eps)


@torch.library.triton_op("titan_kimi::attn_res_mix_backward_triton", mutates_args=())
def attn_res_mix_backward_triton_op(
    grad: torch.Tensor,
    bank: torch.Tensor,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from lowerings.kernels.attn_res_mix import attn_res_mix_backward

    return attn_res_mix_backward(grad, bank, partial, norm_weight, proj_weight, eps)


def _triton_backward(ctx, grad):
    grads = attn_res_mix_backward_triton_op(grad.contiguous(), *ctx.saved_tensors, ctx.eps)
    return (*grads, None)


torch.library.register_autograd("titan_kimi::attn_res_mix_triton", _triton_backward, setup_context=_setup_context)


def attn_res_mix(
    bank: torch.Tensor, partial: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix ``bank [N,m,H]`` and ``partial [N,H]`` with the learned ``norm_weight [H]`` and ``proj_weight [H]``."""
    if bank.dim() != 3 or partial.dim() != 2 or bank.shape[0] != partial.shape[0] or bank.shape[2] != partial.shape[1]:
        raise ValueError(
            f"attn_res_mix expects bank [N,m,H] and partial [N,H], got {tuple(bank.shape)} and {tuple(partial.shape)}"
        )
    args = (bank.contiguous(), partial.contiguous(), norm_weight.reshape(-1), proj_weight.reshape(-1), eps)
    if torch.compiler.is_compiling() and triton_ops_enabled() and _triton(partial):
        return attn_res_mix_triton_op(*args)  # Inductor-visible kernels (the inductor compile mode)
    return attn_res_mix_op(*args)
