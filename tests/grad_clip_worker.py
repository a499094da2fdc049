"""Run by tests/test_grad_clip.py on 2 gloo ranks: clip_gradients over DTensor gradients (FSDP's Shard(0) on
one mesh dim, HSDP's (Replicate, Shard(0)) with each dim of size 2) against torch's clip of the whole tensors."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_kimi.training.optim.grad_clip import clip_gradients
from tests.worker_exit import run_and_exit

SHAPES = [(8, 5), (6,), (3, 4), (5, 2)]  # (6,) and (5, 2) do not split evenly over 2 ranks


def whole_grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def check(mesh, placements, name: str) -> None:
    grads = whole_grads(0)
    params = []
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(g.shape))
        # The last one stays a plain tensor: FSDP leaves the fp32-by-design parameters whole.
        p.grad = distribute_tensor(g.clone(), mesh, placements) if i < len(grads) - 1 else g.clone()
        params.append((f"p{i}", p))
    ref = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    result = clip_gradients(params, 0.5)
    assert abs(result.grad_norm - expected.item()) <= 1e-6 * expected.item(), (name, result.grad_norm, expected)
    for (_, p), r in zip(params, ref):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, r.grad, rtol=1e-6, atol=0)
    if dist.get_rank() == 0:
        print(f"CLIP_OK {name}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    check(init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)), [Shard(0)], "fsdp2")
    check(init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")), [Replicate(), Shard(0)], "hsdp2x1")
    check(init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")), [Replicate(), Shard(0)], "hsdp1x2")
    # Both ranks done before either tears gloo down: under a loaded CI machine one rank's teardown while the
    # other still held the meshes' groups aborted it once ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
