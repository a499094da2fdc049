"""Graph breaks per decoder-block type of a flavor under dynamo: python scripts/check/graph_breaks.py --flavor k31_debug [--device cuda]

    python scripts/check/graph_breaks.py --flavor k31_debug [--seq-len 64] [--device cuda] [--dtype bfloat16]
                                         [--index-training warmup|sparse]

Block types: kda+dense, kda+moe, mla+moe (K3), dsa+moe (K3.1), and the vision tower's block
(``--vision-flavor``, default moonvit3d_debug). Exits 1 if any block breaks.
Real flavors are big: on a CPU machine use the debug flavors; on a GPU any flavor (one layer of each type
is built, not the whole model).
"""

from __future__ import annotations

import argparse
import sys

import torch

from lowerings.inductor.graph_breaks import count_graph_breaks
from titan_kimi.models.kimi_k3 import build_sequence_info, flavor_names, model_args_for
from titan_kimi.models.kimi_k3.block import KimiK3Block


def representative_layers(args) -> dict[str, int]:
    """First layer of each block type in the flavor's layer pattern."""
    kinds: dict[str, int] = {}
    for layer in range(args.n_layers):
        attention = "kda" if args.is_kda_layer(layer) else ("dsa" if args.has_indexer else "mla")
        kinds.setdefault(f"{attention}+{'moe' if args.is_moe_layer(layer) else 'dense'}", layer)
    return kinds


def bank_entries(args, layer: int) -> int:
    """Bank size a layer receives: the embedding and the blocks closed before it (spec §6.3)."""
    block = args.attn_res_block_size
    return layer // block + (1 if layer % block else 0) if block else 0


def check(flavor: str, seq_len: int, device: str, dtype: torch.dtype, index_training: str = "frozen",
          indexer_metrics: bool = False) -> dict[str, int]:
    """``index_training`` warmup / sparse traces the DSA blocks while their indexer trains (a K3.1 flavor; use
    a seq_len above its top-k), with the recall measured when ``indexer_metrics``."""
    args = model_args_for(flavor, index_training=index_training)
    torch.manual_seed(0)
    results = {}
    for kind, layer in representative_layers(args).items():
        with torch.device(device):
            block = KimiK3Block(layer, args)
            block.init_weights()
        block.to(dtype)
        hidden = torch.randn(2, seq_len, args.dim, device=device, dtype=dtype)
        bank = torch.randn(2 * seq_len, bank_entries(args, layer), args.dim, device=device, dtype=dtype)
        doc_ids = torch.ones(2, seq_len, dtype=torch.int32, device=device)
        doc_ids[1, seq_len // 3 :] = 2
        seq = build_sequence_info(2, seq_len, hidden.device, doc_ids)
        seq.indexer_metrics = indexer_metrics
        report = count_graph_breaks(block, hidden, bank, seq)
        results[kind] = report.breaks
        print(f"{flavor} layer {layer:>3} {kind:<10} graphs={report.graphs} graph_breaks={report.breaks}")
        for reason in report.reasons:
            print(f"    break: {reason[:300]}")
    return results


def check_vision(flavor: str, device: str, dtype: torch.dtype) -> dict[str, int]:
    """The vision block of a tower flavor on two packed images of different sizes."""
    from lowerings.ops.vision_attention import block_diagonal_mask
    from titan_kimi.models.kimi_k3.init_specs import init_declared
    from titan_kimi.models.kimi_k3.vision import VisionBlock, vision_init_specs
    from titan_kimi.models.kimi_k3.vision_args import vision_args_for
    from titan_kimi.models.kimi_k3.vision_rope import rope_2d_angles

    args = vision_args_for(flavor)
    torch.manual_seed(0)
    with torch.device(device):
        block = VisionBlock(args)
        init_declared(block, vision_init_specs(block, args.init_std))
    block.to(dtype)
    grids = [(1, 4, 6), (1, 2, 4)]
    x = torch.randn(32, args.dim, device=device, dtype=dtype)
    angles = rope_2d_angles(grids, args.head_dim, args.rope_theta, x.device)
    mask = block_diagonal_mask(torch.tensor([0, 24, 32], device=x.device), 32)
    report = count_graph_breaks(block, x, angles.cos(), angles.sin(), mask)
    print(f"{flavor} vision block graphs={report.graphs} graph_breaks={report.breaks}")
    for reason in report.reasons:
        print(f"    break: {reason[:300]}")
    return {"vision": report.breaks}


def main() -> int:
    from titan_kimi.models.kimi_k3.vision_args import vision_flavor_names

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="k31_debug", choices=flavor_names())
    parser.add_argument("--vision-flavor", default="moonvit3d_debug", choices=["", *vision_flavor_names()],
                        help="also check the vision block of this tower flavor (\"\" = skip)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--index-training", default="frozen", choices=("frozen", "warmup", "sparse"),
                        help="trace the DSA blocks with their indexer training (recall measured too)")
    opts = parser.parse_args()
    results = check(opts.flavor, opts.seq_len, opts.device, getattr(torch, opts.dtype), opts.index_training,
                    indexer_metrics=opts.index_training != "frozen")
    if opts.vision_flavor:
        results.update(check_vision(opts.vision_flavor, opts.device, getattr(torch, opts.dtype)))
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
