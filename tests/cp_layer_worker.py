"""Each attention kind under context parallelism against one process on the whole rows, in fp32, over CP groups
of 4 ranks and of 2 (the world split into two groups, which run the same cases side by side): `run_all`, which
tests/parallel_parity_worker.py runs for tests/test_context_parallel.py in its 4-rank gloo launch
(tests/parity_runs.py), or this script under torchrun.

For the KDA layer (k3_debug), the dense gated MLA (k3_debug) and the K3.1 DSA layer (k31_debug: top-32 of 192
keys per row), in both layouts: outputs, input gradients and parameter gradients (summed over the ranks) of this
rank's tokens against the same layer run on the whole batch in one process. Two rows; documents cross piece
boundaries, one starts exactly on one, and one spans several pieces. Prints from rank 0, one line per case:
``CP <kind> <layout> world <W> out <rel> dx <rel> grads <worst rel> remote <share>`` (remote: the share of the
DSA's selected keys that lie on other ranks; -1 for the other kinds).

``--device cuda`` (tests/test_multi_gpu.py, one GPU per rank): NCCL and the GPU kernels (FLA's cp_context for KDA,
the Triton indexer and sparse MLA), the one-process reference on the same GPU with the same kernels. A world of 2
is then its only CP group.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.delta_attention import KimiDeltaAttention
from titan_kimi.models.kimi_k3.mla import GatedMLA
from titan_kimi.parallel.context_parallel import ContextParallel
from tests.worker_exit import run_and_exit

B, S = 2, 192  # 192 = 2 * 4 * 24: 24-token pieces under zigzag over 4 ranks


def doc_ids(world: int) -> torch.Tensor:
    doc = torch.ones(B, S, dtype=torch.int32)
    piece = S // (2 * world)
    for cut in (5, piece, 2 * piece + 7, S // 2, S // 2 + 1, S - piece - 3):  # on and across piece boundaries
        doc[0, cut:] += 1
    doc[1, S // 3:] += 1  # row 1: two long documents, each over several pieces
    doc[1, -2:] = 0  # and a padding run at the end
    return doc


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run(kind: str, layout: str, group: dist.ProcessGroup, device: torch.device) -> None:
    world = dist.get_world_size(group)
    args = model_args_for("k31_debug" if kind == "dsa" else "k3_debug")
    torch.manual_seed(0)
    layer = KimiDeltaAttention(args) if kind == "kda" else GatedMLA(args)
    layer.init_weights()  # on the CPU, then moved: the same values on every device
    layer.to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, args.dim, generator=gen).to(device)
    cot = torch.randn(B, S, args.dim, generator=gen).to(device)
    doc = doc_ids(world).to(device)

    x_ref = x.clone().requires_grad_()
    y_ref = layer(x_ref, build_sequence_info(B, S, x.device, doc))
    (y_ref * cot).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()

    cp = ContextParallel(group, layout)
    pos = cp.positions(S, device=device)
    x_loc = x[:, pos].clone().requires_grad_()
    seq = cp.build_sequence(B, S // world, x.device, doc)
    remote = -1.0
    if kind == "dsa":
        idx = layer.indexer(x_loc, layer._queries(x_loc)[1], seq)
        local_keys = (torch.arange(B, device=device).unsqueeze(1) * S + pos).reshape(-1)
        chosen = idx[idx >= 0].long()
        remote = float((~torch.isin(chosen, local_keys)).float().mean())
    y = layer(x_loc, seq)
    (y * cot[:, pos]).sum().backward()
    errs = {"out": rel(y.detach(), y_ref.detach()[:, pos]), "dx": rel(x_loc.grad, x_ref.grad[:, pos])}
    worst = 0.0
    for name, p in layer.named_parameters():
        if name in ref_grads:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            worst = max(worst, rel(grad, ref_grads[name]))
    stats = torch.tensor([errs["out"], errs["dx"], worst, remote], device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"CP {kind} {layout} world {world} out {stats[0]:.2e} dx {stats[1]:.2e} grads {stats[2]:.2e} "
              f"remote {stats[3]:.2f}", flush=True)


GPU_KERNELS = {"kda": "fla", "indexer_topk": "triton", "sparse_mla": "triton"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if parser.parse_args().device == "cuda":
        from lowerings.ops.registry import configure_backends
        from lowerings.settings import configure_kernel_settings

        configure_kernel_settings(triton_autotune=False)  # default configs: correctness is checked, not speed

        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        configure_backends(GPU_KERNELS)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    run_all(device)
    dist.barrier()
    dist.destroy_process_group()


def run_all(device: torch.device) -> None:
    """Every case on the default group's ranks (also from tests/parallel_parity_worker.py's launch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    for group in (dist.group.WORLD,) if world == 2 else (dist.group.WORLD, pairs[rank // 2]):
        for kind in ("kda", "mla", "dsa"):
            for layout in ("contiguous", "zigzag"):
                run(kind, layout, group, device)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_and_exit(main)
