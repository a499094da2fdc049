"""The routed experts on CUDA: bf16 grouped GEMMs over 8-row-aligned groups against fp32 on the CPU."""

import pytest
import torch

from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import LatentMoE


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
def test_cuda_experts_match_fp32_with_empty_and_uneven_groups():
    torch.manual_seed(0)
    moe = LatentMoE(model_args_for("k3_debug", num_experts=16, moe_inter_dim=128, moe_latent_dim=128))
    moe.init_weights()
    experts = moe.experts
    counts = torch.tensor([5, 0, 0, 33, 1, 7, 0, 64, 2, 0, 9, 15, 0, 0, 3, 20])
    x = torch.randn(int(counts.sum()), experts.w13.shape[-1])
    cot = torch.randn(x.shape[0], experts.w2.shape[1])
    ref_x = x.clone().requires_grad_()
    ref = experts(ref_x, counts)
    ref.backward(cot)
    gpu = experts.to("cuda", torch.bfloat16)
    gx = x.to("cuda", torch.bfloat16).requires_grad_()
    out = gpu(gx, counts.cuda())
    out.backward(cot.to("cuda", torch.bfloat16))
    assert rel_err(out.float().cpu(), ref) < 1e-2
    assert rel_err(gx.grad.float().cpu(), ref_x.grad) < 1e-2


@pytest.mark.gpu
def test_cuda_latent_moe_forward_backward_matches_cpu():
    torch.manual_seed(1)
    moe = LatentMoE(model_args_for("k3_debug"))
    moe.init_weights()
    x = torch.randn(2, 37, 128)
    ref = moe(x)
    cuda = LatentMoE(model_args_for("k3_debug")).cuda()
    cuda.load_state_dict(moe.state_dict())
    out = cuda(x.cuda())
    assert rel_err(out.cpu(), ref) < 1e-4
    assert cuda.tokens_per_expert.sum().item() == 2 * 37 * moe.top_k


@pytest.mark.gpu
def test_moe_without_expert_parallelism_never_waits_for_the_host():
    """EP = 1: routing, the aligned grouped GEMMs, the load counter and the combine queue work without a
    device-to-host sync (CUDA's sync debug mode raises on any)."""
    torch.manual_seed(2)
    moe = LatentMoE(model_args_for("k3_debug", num_experts=16))
    moe.init_weights()
    moe = moe.cuda().to(torch.bfloat16)
    moe.router.float()
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).sum().backward()  # warm-up: first calls may initialise libraries
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["reference", "triton"])
def test_cuda_padding_tokens_skip_the_routed_experts(combine):
    """Padding tokens' choices sort past the counts and the aligned grouped GEMMs leave them zero, with either
    dispatch and combine backend: the layer and its gradients match the CPU's fp32; in bf16 the path queues
    without a host sync (fp32 grouped GEMMs synchronise on their own)."""
    from lowerings.ops.registry import configure_backends

    torch.manual_seed(3)
    args = model_args_for("k3_debug", num_experts=16)
    moe = LatentMoE(args)
    moe.init_weights()
    x = torch.randn(2, 64, 128)
    is_real = torch.zeros(2, 64, dtype=torch.bool)
    is_real[0, :41] = True
    is_real[1, :7] = True
    is_real = is_real.view(-1)
    ref_x = x.clone().requires_grad_()
    ref = moe(ref_x, is_real)
    cot = torch.randn_like(ref)
    ref.backward(cot)
    cuda = LatentMoE(args).cuda()
    cuda.load_state_dict(moe.state_dict())
    configure_backends({"routed_combine": combine})
    try:
        gx = x.cuda().requires_grad_()
        out = cuda(gx, is_real.cuda())
        out.backward(cot.cuda())
        assert rel_err(out.detach().cpu(), ref) < 1e-4
        assert rel_err(gx.grad.cpu(), ref_x.grad) < 1e-4
        for name, p in moe.named_parameters():
            if p.grad is not None:
                assert rel_err(dict(cuda.named_parameters())[name].grad.cpu(), p.grad) < 1e-4, name
        bf16 = cuda.to(torch.bfloat16)
        bf16.router.float()
        bx, real = x.to("cuda", torch.bfloat16).requires_grad_(), is_real.cuda()  # (host copies synchronise)
        bf16(bx, real).sum().backward()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = bf16(bx, real)
            y.backward(torch.ones_like(y))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.isfinite(bx.grad).all()
    finally:
        configure_backends({"routed_combine": "reference"})
