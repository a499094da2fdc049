"""The model FLOPs of every pipeline stage for one microbatch: per decoder layer (with its kind), the vision
tower's share on the first stage and the head on the last, from the layer-FLOP counts of meta-device blocks.

Shared by the rank-slice benchmark (which stage is busiest; the layers it did not build) and the step-time
estimate (compute per stage, and the FLOP-rate fallback without a measured table).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.block import KimiK3Block
from titan_kimi.models.kimi_k3.layer_flops import ZERO, LayerFlops, block_flops, head_flops, weight_flops
from titan_kimi.models.kimi_k3.vision_accounting import vision_flops


BLOCK_START = ", block start"


def layer_kind(args: KimiK3ModelArgs, layer: int, dsa_dense: bool) -> str:
    """``<attention>+<ffn>[, block start]``: kda, mla (dense attention, also a DSA layer on its dense
    shortcut), dsa (indexer + sparse attention); moe or dense."""
    if args.is_kda_layer(layer):
        attention = "kda"
    else:
        attention = "dsa" if args.has_indexer and not dsa_dense else "mla"
    block = args.attn_res_block_size
    start = bool(block) and layer % block == 0
    return f"{attention}+{'moe' if args.is_moe_layer(layer) else 'dense'}" + (BLOCK_START if start else "")


def without_block_start(kind: str) -> str | None:
    """The kind of the same layer inside an AttnRes block, for a block-start kind (else None): a block start
    appends the hidden state to the bank and drops the residual add, the same GEMMs and kernels otherwise."""
    return kind[: -len(BLOCK_START)] if kind.endswith(BLOCK_START) else None


@functools.lru_cache(maxsize=64)
def _meta_block(args_key: tuple, layer: int) -> KimiK3Block:
    args = KimiK3ModelArgs(**dict(args_key))
    with torch.device("meta"):
        block = KimiK3Block(layer, args)
    if block.attention.__class__.__name__ == "GatedMLA" and block.attention.indexer is not None:
        block.attention.indexer.requires_grad_(False)
    return block


@functools.lru_cache(maxsize=4096)
def _layer_flops(args_key: tuple, layer: int, segments: tuple[int, ...], routed_rows: int, dsa_dense: bool) -> LayerFlops:
    args = KimiK3ModelArgs(**dict(args_key))
    return block_flops(_meta_block(args_key, layer), args, segments, routed_rows=routed_rows, dsa_dense=dsa_dense)


@functools.lru_cache(maxsize=256)
def _shared_expert_flops(args_key: tuple, layer: int, tokens: int) -> LayerFlops:
    block = _meta_block(args_key, layer)
    shared = block.moe.shared_experts if block.moe_enabled else None
    return weight_flops(shared, tokens) if shared is not None else ZERO


def shared_expert_flops(args: KimiK3ModelArgs, layer: int, tokens: int) -> LayerFlops:
    """The shared experts of MoE layer ``layer`` on ``tokens`` rows (zero for a dense layer or none): the work
    the MoE runs beside one of its expert-parallel exchanges."""
    return _shared_expert_flops(_args_key(args), _representative(args, layer), tokens)


def _args_key(args: KimiK3ModelArgs) -> tuple:
    return tuple((f, getattr(args, f)) for f in args.__dataclass_fields__)


def _representative(args: KimiK3ModelArgs, layer: int) -> int:
    """A layer with the same FLOPs as ``layer`` (same mixer and FFN), to build once per kind."""
    for other in range(layer + 1):
        if args.is_kda_layer(other) == args.is_kda_layer(layer) and args.is_moe_layer(other) == args.is_moe_layer(layer):
            return other
    return layer


@dataclass(frozen=True)
class StageWork:
    stage: int
    layers: tuple[tuple[int, str, LayerFlops], ...]  # (layer, kind, FLOPs)
    vision: LayerFlops
    head: LayerFlops

    @property
    def total(self) -> LayerFlops:
        out = self.vision + self.head
        for _, _, f in self.layers:
            out = out + f
        return out


def stage_work(args: KimiK3ModelArgs, stage: int, layer_range: tuple[int, int], segments: list[int], *,
               routed_rows: int, dsa_dense: bool, vision=None, grids=(), tower_trained: bool = False,
               projector_trained: bool = True, head_trained: bool = True) -> StageWork:
    """Stage ``stage`` holding layers ``layer_range`` on a microbatch of ``segments`` (run lengths, every row's),
    its local experts receiving ``routed_rows`` rows per MoE layer; ``vision`` (args) and ``grids``: the first
    stage's images."""
    first, last = layer_range
    key = _args_key(args)
    layers = [(layer, layer_kind(args, layer, dsa_dense),
               _layer_flops(key, _representative(args, layer), tuple(segments), routed_rows, dsa_dense))
              for layer in range(first, last)]
    image = ZERO
    if vision is not None and first == 0 and grids:
        fwd = vision_flops(vision, args.dim, grids, tower_trained=False, projector_trained=False)
        total = vision_flops(vision, args.dim, grids, tower_trained=tower_trained,
                             projector_trained=projector_trained)
        image = LayerFlops(fwd, (total - fwd) / 2, (total - fwd) / 2)
    head = head_flops(args, sum(segments), trained=head_trained) if last == args.n_layers else ZERO
    return StageWork(stage, tuple(layers), image, head)
