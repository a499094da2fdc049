"""The compile-mode registry shared by training and the ablation script.

| mode | what runs |
|---|---|
| none | eager |
| default | per-block torch.compile (Inductor); the titan_kimi ops stay opaque custom ops |
| inductor | as default, plus: the Triton kernels of situ_glu and attn_res_mix run as `torch.library.triton_op`s (Inductor sees, schedules and plans memory for them; CUDA + triton backend only), SiTU-GLU is emitted as its plain formula and our joint-graph pass rewrites it into the fused op (forward and backward) |
| max-autotune | as default, with Inductor's pointwise/reduction autotuning (GEMMs stay ATen, no CUDA graphs) |
| reduce-overhead | as default, with CUDA graphs (Inductor graph partitions: ops tagged `cudagraph_unsafe`, the context-parallel KDA op and the linear cross-entropy, run between the graphs, not in them) |

A mode has two halves: ``compile_options`` (the ``torch.compile`` keyword arguments, which carry the graph pass
through ``options`` so it is installed exactly while these regions compile, backward included) and
``lowering_scope`` (how the titan_kimi ops lower while Dynamo traces; must be active around every call of a
compiled region, see ``titan_kimi.parallel.compile``). On CPU the ``inductor`` mode has no triton_op path (no
CUDA): the ops keep their reference backends and only the SiTU-GLU rewrite applies.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, ContextManager

from lowerings.ops.registry import compile_lowering

# Ops the inductor mode emits as plain torch for a pattern to fuse back (one pattern module per op).
DECOMPOSED_OPS: tuple[str, ...] = ("situ_glu",)


@dataclass(frozen=True)
class CompileMode:
    name: str
    compiled: bool = True
    torch_mode: str | None = None  # torch.compile(mode=...)
    triton_ops: bool = False  # Inductor-visible triton_op variants of our kernels
    graph_passes: bool = False  # emit DECOMPOSED_OPS as formulas and run TitanKimiJointPass
    cudagraphs: bool = False  # CUDA graphs over Inductor's graph partitions (see `compile_options`)
    inductor_options: tuple[tuple[str, Any], ...] = ()  # further Inductor config, as (name, value) pairs

    def compile_options(self) -> dict[str, Any] | None:
        if not self.compiled:
            return None
        options: dict[str, Any] = {"backend": "inductor"}
        if self.torch_mode is not None:
            options["mode"] = self.torch_mode
        # torch.compile takes `mode` or `options`, not both; the modes that need options set no torch mode.
        inductor_options: dict[str, Any] = dict(self.inductor_options)
        if self.graph_passes:
            inductor_options["joint_custom_post_pass"] = _joint_pass(self.triton_ops)
        if self.cudagraphs:
            # torch's reduce-overhead is `triton.cudagraphs`; graph partitioning is spelled out because ops
            # tagged cudagraph_unsafe (the context-parallel KDA op, the chunked linear cross-entropy) must run
            # between graphs, never inside one.
            inductor_options.update({"triton.cudagraphs": True, "graph_partition": True})
        if inductor_options:
            options["options"] = inductor_options
        return options

    def lowering_scope(self) -> ContextManager[None]:
        if not self.compiled:
            return contextlib.nullcontext()
        return compile_lowering(triton_ops=self.triton_ops, decomposed=DECOMPOSED_OPS if self.graph_passes else ())


@functools.lru_cache(maxsize=None)
def _joint_pass(triton_ops: bool):
    """One pass object per setting, shared by every block (its patterns are traced once, on first use)."""
    from lowerings.inductor.passes import TitanKimiJointPass

    return TitanKimiJointPass(triton_ops=triton_ops)


_MODES: dict[str, CompileMode] = {m.name: m for m in (
    CompileMode("none", compiled=False),
    CompileMode("default"),
    CompileMode("inductor", triton_ops=True, graph_passes=True),
    # torch's max-autotune-no-cudagraphs with GEMM choices kept to ATen: on torch 2.11 (H200, CUDA 13) Inductor's
    # Triton grouped-GEMM template fails to compile for the experts' cast + transposed weights ("Tensor descriptor
    # last dim must be 1 but got 1024"), which fails the whole step; pointwise / reduction autotuning stays on.
    CompileMode("max-autotune", inductor_options=(("max_autotune", True), ("coordinate_descent_tuning", True),
                                                  ("max_autotune_gemm_backends", "ATEN"))),
    CompileMode("reduce-overhead", cudagraphs=True),
)}


def compile_mode_names() -> list[str]:
    return list(_MODES)


def compile_mode(mode: str) -> CompileMode:
    if mode not in _MODES:
        raise ValueError(f"compile.mode = {mode!r} is not available; valid: {compile_mode_names()}")
    return _MODES[mode]


def compile_options(mode: str) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments for ``mode`` (graph passes included); None for eager."""
    return compile_mode(mode).compile_options()


def lowering_scope(mode: str) -> ContextManager[None]:
    """The op-lowering flags of ``mode``, to hold around every call of a region compiled under it."""
    return compile_mode(mode).lowering_scope()
