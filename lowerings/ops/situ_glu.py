"""``titan_kimi::situ_glu``: SiTU-GLU on a fused ``[gate | up]`` tensor, with an analytic backward.

Two registrations of the same contract: the opaque ``custom_op`` (eager and the ``default`` compile modes) and
``situ_glu_triton``, a ``torch.library.triton_op`` whose body launches the Triton kernels through
``wrap_triton`` so Inductor sees them (the ``inductor`` compile mode, triton backend, CUDA). Under the
``inductor`` mode the wrapper emits the plain formula instead and a graph pass
(``lowerings.inductor.situ_glu_pattern``) rewrites it into the fused op.
"""

from __future__ import annotations

import torch

from lowerings.ops.registry import cuda_available, emits_formula, op_backends, selected_backend, triton_ops_enabled

BACKENDS = op_backends("situ_glu")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def situ_glu_reference(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """beta tanh(g/beta) sigmoid(g) * beta_lin tanh(u/beta_lin), in fp32, cast to the input dtype."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))).to(gate_up.dtype)


def situ_glu_backward_reference(grad: torch.Tensor, gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    dy = grad.float()
    th, sg, tu = torch.tanh(g / beta), torch.sigmoid(g), torch.tanh(u / beta_lin)
    situ, clip = beta * th * sg, beta_lin * tu
    d_situ = (1 - th * th) * sg + beta * th * sg * (1 - sg)
    d_clip = 1 - tu * tu
    return torch.cat([dy * clip * d_situ, dy * situ * d_clip], dim=-1).to(gate_up.dtype)


@torch.library.custom_op("titan_kimi::situ_glu", mutates_args=())
def situ_glu_op(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    if selected_backend("situ_glu") == "triton" and gate_up.is_cuda:
        from lowerings.kernels.situ_glu import situ_glu_forward

        return situ_glu_forward(gate_up, beta, beta_lin)
    return situ_glu_reference(gate_up, beta, beta_lin)


@situ_glu_op.register_fake
def _(gate_up, beta, beta_lin):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("titan_kimi::situ_glu_backward", mutates_args=())
def situ_glu_backward_op(grad: torch.Tensor, gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    if selected_backend("situ_glu") == "triton" and gate_up.is_cuda:
        from lowerings.kernels.situ_glu import situ_glu_backward

        return situ_glu_backward(grad, gate_up, beta, beta_lin)
    return situ_glu_backward_reference(grad, gate_up, beta, beta_lin)


@situ_glu_backward_op.register_fake
def _(grad, gate_up, beta, beta_lin):
    return torch.empty_like(gate_up)


def _setup_context(ctx, inputs, output):
    gate_up, beta, beta_lin = inputs
    ctx.save_for_backward(gate_up)
    ctx.betas = (beta, beta_lin)


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return situ_glu_backward_op(grad.contiguous(), gate_up, *ctx.betas), None, None


torch.library.register_autograd("titan_kimi::situ_glu", _backward, setup_context=_setup_context)


@torch.library.triton_op("titan_kimi::situ_glu_triton", mutates_args=())
def situ_glu_triton_op(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    from lowerings.kernels.situ_glu import situ_glu_forward

    return situ_glu_forward(gate_up, beta, beta_lin)


@torch.library.triton_op("titan_kimi::situ_glu_backward_triton", mutates_args=())
def situ_glu_backward_triton_op(grad: torch.Tensor, gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    from lowerings.kernels.situ_glu import situ_glu_backward

    return situ_glu_backward(grad, gate_up, beta, beta_lin)


def _triton_backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return situ_glu_backward_triton_op(grad.contiguous(), gate_up, *ctx.betas), None, None


torch.library.register_autograd("titan_kimi::situ_glu_triton", _triton_backward, setup_context=_setup_context)


def situ_glu_fused(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """The fused op: the Inductor-visible triton_op when the compile lowering asks for it and the triton
    backend runs on CUDA, else the opaque custom op (which dispatches to the selected backend)."""
    if triton_ops_enabled() and selected_backend("situ_glu") == "triton" and gate_up.is_cuda:
        return situ_glu_triton_op(gate_up, beta, beta_lin)
    return situ_glu_op(gate_up, beta, beta_lin)


def situ_glu(gate_up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of ``gate_up [..., 2F]`` (gate first) -> ``[..., F]``."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"situ_glu needs an even last dim ([gate | up]), got shape {tuple(gate_up.shape)}")
    if torch.compiler.is_compiling():
        if emits_formula("situ_glu"):
            return situ_glu_reference(gate_up, beta, beta_lin)  # rewritten into the fused op by the graph pass
        return situ_glu_fused(gate_up.contiguous(), beta, beta_lin)
    return situ_glu_op(gate_up.contiguous(), beta, beta_lin)
