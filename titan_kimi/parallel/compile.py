"""Per-block torch.compile under the ``[compile]`` modes (the mode registry lives in lowerings.inductor)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch._dynamo

from lowerings.inductor.modes import CompileMode, compile_mode
from titan_kimi.models.kimi_k3.model import KimiK3Model


class _ForwardScope:
    """Holds the mode's lowering flags and recompile limit from a forward's pre-hook to its (always-called)
    hook: Dynamo traces the compiled blocks inside the model forward, so that is where both must hold."""

    def __init__(self, spec: CompileMode, recompile_limit: int) -> None:
        self.spec, self.recompile_limit = spec, recompile_limit
        self._stacks: list[contextlib.ExitStack] = []

    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        spec = self.spec
        if spec.cudagraphs:
            # each forward starts a new CUDA-graph generation: the previous one's outputs are dead by now
            # (its backward ran), which cudagraph trees cannot infer across separately compiled blocks.
            torch.compiler.cudagraph_mark_step_begin()
        stack = contextlib.ExitStack()
        stack.enter_context(spec.lowering_scope())
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=self.recompile_limit,
            accumulated_recompile_limit=max(torch._dynamo.config.accumulated_recompile_limit, self.recompile_limit)))
        self._stacks.append(stack)

    def exit(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._stacks:
            self._stacks.pop().close()


GRANULARITIES = ("block", "module")


def apply_compile(model: KimiK3Model, mode: str, *, fullgraph: bool, experts_outside: bool = False,
                  granularity: str = "block") -> None:
    """Compile every decoder block (and vision block) in place (parameter names unchanged); ``none`` leaves the
    model eager. Vision blocks never get CUDA graphs (their input length changes with the images).

    ``granularity``: ``block`` compiles each decoder block whole (the most fusion). The blocks share one code
    object, so Dynamo compiles every block variant (block type, AttnRes bank size and block start, which inputs
    need grad) as its own graph, each holding its attention and FFN again: k3_small's 16 layers make 6 graphs.
    ``module`` compiles a block's norms, attention and FFN (MoE or dense) separately, so each kind compiles once
    for the whole stack (k3_small: 5 small graphs; MLA's FlexAttention and the MoE once each, not per variant);
    the residual adds and AttnRes mixes between them run as they are (one op each). Either way the recompile
    limit is raised to cover the stack, inside the forward only, rather than failing a fullgraph compile at
    Dynamo's default of 8.

    ``experts_outside`` (expert parallelism): the expert dispatch reads token counts on the host for its
    all-to-all, which no graph can hold; MoE blocks then compile each of their sub-modules except the routed
    experts (torchtitan's rule), whose grouped GEMM and fused SiTU-GLU run as they are.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"compile granularity {granularity!r} is not one of {GRANULARITIES}")
    spec = compile_mode(mode)
    options = spec.compile_options()
    if options is None:
        return
    for block in model.layers.values():
        for region in _compiled_regions(block, granularity, experts_outside):
            region.compile(fullgraph=fullgraph, **options)
    vision_tower = getattr(model, "vision_tower", None)  # an image-text model's first stage
    if vision_tower is not None:
        # The tower's patch count changes with every batch of images, so a CUDA graph there would be recorded
        # again for each new count (k31_vl_small: a new size at most steps, 14,931 vs 17,454 tokens/s without
        # graphs, docs/perf.md); its blocks compile under the same mode without CUDA graphs.
        vision_options = dataclasses.replace(spec, cudagraphs=False).compile_options()
        for block in vision_tower.encoder.blocks:
            block.compile(fullgraph=fullgraph, **vision_options)
    limit = max(torch._dynamo.config.recompile_limit, 8 * len(model.layers) + 8)
    scope = _ForwardScope(spec, limit)
    model.register_forward_pre_hook(scope.enter)
    model.register_forward_hook(scope.exit, always_call=True)


def _compiled_regions(block: torch.nn.Module, granularity: str, experts_outside: bool) -> list[torch.nn.Module]:
    inner = getattr(block, "_checkpoint_wrapped_module", block)  # activation checkpointing's wrapper
    if experts_outside and getattr(inner, "moe_enabled", False):
        return _moe_block_parts(inner)
    if granularity == "block":
        return [block]
    return module_regions(inner)


def module_regions(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The regions ``granularity = module`` compiles in a decoder block: attention norm, attention, FFN norm, FFN."""
    ffn = block.moe if block.moe_enabled else block.feed_forward
    return [block.attention_norm, block.attention, block.ffn_norm, ffn]


def _moe_block_parts(block: torch.nn.Module) -> list[torch.nn.Module]:
    # The project's own modules; the latent projections are single nn.Linear matmuls (nothing to fuse, and
    # torch's own module frames are not compiled on their own).
    moe = block.moe
    parts = [block.attention, block.attention_norm, block.ffn_norm, moe.router, moe.shared_experts,
             moe.routed_expert_norm]
    parts += [block.attention_mix, block.ffn_mix] if block.block_size else []
    return [p for p in parts if p is not None]


def apply_loss_compile(head: torch.nn.Module, mode: str, *, fullgraph: bool) -> None:
    """``compile.components`` holding ``loss``: the head's fused linear cross-entropy op (and its logits path)."""
    options = compile_mode(mode).compile_options()
    if options is not None:
        head.compile(fullgraph=fullgraph, **options)
