"""``titan_kimi::short_conv``: the KDA layers' causal depthwise convolution with SiLU, reset at segment starts.

The reference is the model's formula (shifted multiply-adds in fp32), which Inductor fuses where it compiles;
the ``triton`` backend runs the kernels of ``lowerings/kernels/short_conv.py`` (one bandwidth-bound pass
forward, two backward: the gate's gradient with the weight gradient's partial sums, then ``dx``) where the layer
runs eager. Inside a compiled region both backends trace the formula: Inductor's fused kernels for it are slower
than ours alone, but the compiled layers measured the same either way (docs/perf.md), so the compiled recipes
keep the graphs their numbers were measured with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowerings.autocast import autocast_off
from lowerings.ops.registry import cuda_available, on_cuda, op_backends, selected_backend

BACKENDS = op_backends("short_conv")
BACKENDS.add("triton", cuda_available, auto_rank=0)


def _preactivation(x: torch.Tensor, weight: torch.Tensor,
                   pos_in_seg: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``a = sum_i w[:, W-1-i] taps[i]`` in fp32 and the taps: ``taps[i][t] = x[t-i]`` where ``t`` is at least ``i``
    tokens into its segment (else 0)."""
    S, W = x.shape[1], weight.shape[-1]
    w, xf = weight.float(), x.float()
    taps, a = [xf], xf * w[:, -1]
    for shift in range(1, W):
        past = F.pad(xf, (0, 0, shift, 0))[:, :S]
        taps.append(past * (pos_in_seg >= shift).unsqueeze(-1) if pos_in_seg is not None else past)
        a = a + taps[-1] * w[:, -1 - shift]
    return a, taps


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, pos_in_seg: torch.Tensor | None) -> torch.Tensor:
    """``SiLU(sum_i w[:, W-1-i] x[t-i])`` over the current segment, fp32 math, ``x``'s dtype out.

    ``x [B,S,C]``, ``weight [C, W]`` (``w[:, W-1]`` multiplies the current token), ``pos_in_seg [B,S]`` or None
    (then only the row's start cuts the window). Shifted multiply-adds, so Inductor fuses it into one kernel.
    """
    return F.silu(_preactivation(x, weight, pos_in_seg)[0]).to(x.dtype)


def short_conv_backward_reference(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  pos_in_seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx in x's dtype, dw [C, W] fp32)``: with ``g = dy SiLU'(a)``, ``dx[t] = sum_i w[:, W-1-i] g[t+i]`` where
    ``t+i`` is at least ``i`` tokens into its segment, ``dw[:, W-1-i] = sum_t g[t] x[t-i]`` likewise."""
    W, w = weight.shape[-1], weight.float()
    a, taps = _preactivation(x, weight, pos_in_seg)
    sig = torch.sigmoid(a)
    g = grad.float() * sig * (1 + a * (1 - sig))
    dw = torch.stack([(g * taps[i]).sum((0, 1)) for i in range(W)], dim=-1).flip(-1)
    dx = g * w[:, -1]
    for i in range(1, W):
        gi = g * (pos_in_seg >= i).unsqueeze(-1) if pos_in_seg is not None else g
        dx = dx + F.pad(gi, (0, 0, 0, i))[:, i:] * w[:, W - 1 - i]
    return dx.to(x.dtype), dw


def _use_triton(x: torch.Tensor) -> bool:
    return selected_backend("short_conv") == "triton" and on_cuda(x)


@torch.library.custom_op("titan_kimi::short_conv", mutates_args=())
def short_conv_op(x: torch.Tensor, weight: torch.Tensor, pos_in_seg: torch.Tensor | None) -> torch.Tensor:
    with autocast_off(x):
        if _use_triton(x):
            from lowerings.kernels.short_conv import short_conv_forward

            return short_conv_forward(x, weight, pos_in_seg)
        return short_conv_reference(x, weight, pos_in_seg)


@short_conv_op.register_fake
def _(x, weight, pos_in_seg):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("titan_kimi::short_conv_backward", mutates_args=())
def short_conv_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           pos_in_seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast_off(x):
        if _use_triton(x):
            from lowerings.kernels.short_conv import short_conv_backward

            return short_conv_backward(grad, x, weight, pos_in_seg)
        return short_conv_backward_reference(grad, x, weight, pos_in_seg)


@short_conv_backward_op.register_fake
def _(grad, x, weight, pos_in_seg):
    return torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape,
                                                                                        dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, pos_in_seg = inputs
    ctx.save_for_backward(x, weight, pos_in_seg)


def _backward(ctx, grad):
    x, weight, pos_in_seg = ctx.saved_tensors
    dx, dw = short_conv_backward_op(grad.contiguous(), x, weight, pos_in_seg)
    return dx, dw.to(weight.dtype), None


torch.library.register_autograd("titan_kimi::short_conv", _backward, setup_context=_setup_context)


def short_conv(x: torch.Tensor, weight: torch.Tensor, pos_in_seg: torch.Tensor | None) -> torch.Tensor:
    """The short convolution of ``x [B,S,C]`` with ``weight [C, W]`` (or the module's ``[C, 1, W]``).

    The reference backend, any call off CUDA and any call inside a compiled region run the formula itself (there
    Inductor fuses it with its neighbours); the triton backend on CUDA calls the op where the layer runs eager.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"short_conv: expected x [B,S,C] and weight [C,W] (or [C,1,W]), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not _use_triton(x) or torch.compiler.is_compiling():
        # inside a compiled region Inductor fuses the formula with its neighbours: as fast as the kernels in the
        # layers measured (docs/perf.md), and the compiled recipes' measured steps stay what they were
        return short_conv_reference(x, weight, pos_in_seg)
    pos = pos_in_seg.contiguous() if pos_in_seg is not None else None
    return short_conv_op(x.contiguous(), weight.float().contiguous(), pos)
