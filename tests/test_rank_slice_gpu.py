"""The rank slice's local dispatch on CUDA (torchtitan's Triton permutation, bf16 grouped GEMMs over its aligned
groups) against the MoE's own path in fp32 on the CPU, forward and backward, on fresh random inputs."""

import copy

import pytest
import torch

from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import LatentMoE
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad
from titan_kimi.parallel.rank_slice.local_experts import localize_experts


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
def test_local_dispatch_on_cuda_matches_the_fp32_moe():
    """The rank receives exactly its own routed rows in the routing's groups (one source rank): its output and
    input gradient must equal the MoE's own."""
    torch.manual_seed(0)
    args = model_args_for("k3_debug", num_experts=16, moe_inter_dim=128, moe_latent_dim=128)
    moe = LatentMoE(args)
    moe.init_weights()
    x = torch.randn(2, 64, args.dim)
    with torch.no_grad():
        _, indices = moe.router(x.view(-1, args.dim))
    counts = torch.bincount(indices.view(-1), minlength=args.num_experts).view(1, -1)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    local = copy.deepcopy(moe).to("cuda", torch.bfloat16)
    holder.layers["0"].moe_enabled, holder.layers["0"].moe = True, local
    localize_experts(holder, ExpertLoad(counts, "measured", 1.0, 1.0))
    ref_x = x.clone().requires_grad_()
    ref = moe(ref_x)
    cot = torch.randn_like(ref)
    ref.backward(cot)
    gx = x.to("cuda", torch.bfloat16).requires_grad_()
    out = local(gx)
    out.backward(cot.to("cuda", torch.bfloat16))
    assert rel_err(out.float().cpu(), ref) < 2e-2
    assert rel_err(gx.grad.float().cpu(), ref_x.grad) < 2e-2


@pytest.mark.gpu
def test_cuda_permutation_of_received_rows_matches_the_cpu_one():
    """The layout the local dispatch feeds torchtitan (rows from 4 source ranks for 8 local experts, some empty):
    the Triton permutation on CUDA groups and pads them exactly as the CPU path does."""
    from titan_kimi.parallel.expert_parallel import _permutation_on_any_device
    from torchtitan.models.moe.utils import _permute

    _permutation_on_any_device()
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 40, (4, 8), generator=gen)
    counts[1, 3] = counts[:, 5] = 0
    x = torch.randn(int(counts.sum()), 32, generator=gen)
    _, cpu_rows, cpu_index, cpu_counts = _permute(x, counts.reshape(-1), 4, 8)
    _, gpu_rows, gpu_index, gpu_counts = _permute(x.cuda(), counts.reshape(-1).cuda(), 4, 8)
    assert torch.equal(gpu_index.cpu(), cpu_index) and torch.equal(gpu_counts.cpu(), cpu_counts)
    assert torch.equal(gpu_rows.cpu(), cpu_rows)
