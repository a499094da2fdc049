"""Pattern: the plain SiTU-GLU formula on the halves of a ``[gate | up]`` tensor -> the fused titan_kimi op.

Registered twice per dtype: on the joint forward+backward graph (``joint_fwd_bwd``: the formula and its
autograd backward are replaced by the fused op and its backward op, so both directions are fused) and on
inference graphs (``fwd_only``). The search function is the op's own reference, so what the model emits under
the ``inductor`` mode (``lowerings.ops.situ_glu`` with ``emits_formula``) is exactly what is matched.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, joint_fwd_bwd, register_replacement

from lowerings.ops.registry import selected_backend
from lowerings.ops.situ_glu import situ_glu_op, situ_glu_reference, situ_glu_triton_op

# The tracer bakes python floats into the graph; distinct sentinel values let the matcher map each constant
# back to its argument (beta appears in the forward and the backward, beta_lin likewise).
_SENTINELS = {"beta": 0.7123, "beta_lin": 1.9371}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the formula's casts differ per input dtype


def _search(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    return situ_glu_reference(gate_up, beta, beta_lin)


def fused_replacement(triton_ops: bool) -> Callable[[torch.Tensor, float, float], torch.Tensor]:
    """The fused op a match becomes: the Inductor-visible triton_op on CUDA when the mode asks for it and the
    triton backend is selected, else the opaque custom op (which runs the selected backend)."""

    def replace(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
        if triton_ops and selected_backend("situ_glu") == "triton" and gate_up.is_cuda:
            return situ_glu_triton_op(gate_up, beta, beta_lin)
        return situ_glu_op(gate_up, beta, beta_lin)

    return replace


def register_situ_glu_patterns(patterns: PatternMatcherPass, *, triton_ops: bool) -> None:
    """Add the training and inference patterns of every supported dtype to ``patterns``."""
    replace = fused_replacement(triton_ops)
    for dtype in _DTYPES:
        for trace_fn in (joint_fwd_bwd, fwd_only):
            # Shapes are placeholders: the matcher ignores them and re-traces each match at its real shape.
            example = torch.empty(4, 16, dtype=dtype, requires_grad=trace_fn is joint_fwd_bwd)
            register_replacement(_search, replace, [example], trace_fn, patterns, scalar_workaround=_SENTINELS)
