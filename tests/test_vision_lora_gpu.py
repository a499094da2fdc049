"""The image-text model's GPU paths: masked SDPA within images, LoRA factors in the CUDA grouped GEMMs, and a
whole image-text step on CUDA (bf16, the default kernels) against fp32 on the CPU."""

import pytest
import torch

from lowerings.ops.vision_attention import block_diagonal_mask, vision_attention, vision_attention_reference
from titan_kimi.lora.modules import add_adapter
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import LatentMoE


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
def test_vision_attention_on_cuda_stays_within_each_image():
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 356, 357, 1000])  # images of 100, 256, 1 and 643 patches
    q, k, v = (torch.randn(1000, 16, 72) for _ in range(3))
    ref = vision_attention_reference(q, k, v, cu, scale=72**-0.5)
    qg, kg, vg = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = vision_attention(qg, kg, vg, block_diagonal_mask(cu.cuda(), 1000), scale=72**-0.5)
    assert rel_err(out.float().cpu(), ref) < 2e-2
    cot = torch.randn_like(out)
    out.backward(cot)
    exact = [t.clone().double().requires_grad_() for t in (q, k, v)]
    vision_attention_reference(*exact, cu, scale=72**-0.5).backward(cot.double().cpu())
    for got, want in zip((qg, kg, vg), exact):
        assert rel_err(got.grad.float().cpu(), want.grad) < 3e-2


@pytest.mark.gpu
def test_lora_experts_on_cuda_match_fp32():
    """Per-expert low-rank factors inside the CUDA grouped GEMMs (8-row-aligned groups, empty experts)."""
    torch.manual_seed(1)
    moe = LatentMoE(model_args_for("k3_debug", num_experts=16))
    moe.init_weights()
    experts = add_adapter(moe.experts, rank=8, alpha=16.0, dropout=0.0)
    experts.w13.requires_grad_(False)  # as apply_lora freezes the base weights
    experts.w2.requires_grad_(False)
    with torch.no_grad():  # B = 0 at init: give the adapters a non-zero update to compare
        for name in ("lora_B_w13", "lora_B_w2"):
            getattr(experts, name).normal_(0, 0.05)
    counts = torch.tensor([5, 0, 3, 33, 1, 7, 0, 20, 2, 0, 9, 15, 0, 0, 3, 11])
    x = torch.randn(int(counts.sum()), experts.w13.shape[-1])
    cot = torch.randn(x.shape[0], experts.w2.shape[1])
    ref = experts(x, counts)
    ref.backward(cot)
    ref_grad = experts.lora_A_w13.grad.clone()
    gpu = experts.to("cuda", torch.bfloat16)
    gpu.zero_grad()
    out = gpu(x.to("cuda", torch.bfloat16), counts.cuda())
    out.backward(cot.to("cuda", torch.bfloat16))
    assert rel_err(out.float().cpu(), ref) < 2e-2
    assert rel_err(gpu.lora_A_w13.grad.float().cpu(), ref_grad) < 3e-2
    assert gpu.w13.grad is None  # the base weights are frozen


@pytest.mark.gpu
def test_image_text_step_on_cuda_matches_the_cpu():
    """k31_debug + the debug tower: loss on CUDA (bf16 autocast, every op on its default GPU kernel) within 2% of
    fp32 on the CPU (reference ops), and the trained projector gets gradients."""
    from test_multimodal_model import batch, build

    from lowerings.catalog import BACKEND_OPS
    from lowerings.ops.registry import configure_backends
    from titan_kimi.training.loss import LinearCrossEntropyLoss

    tokens, pixels, grids, doc_ids = batch(seed=3)
    labels = torch.randint(0, 2048, doc_ids.shape, generator=torch.Generator().manual_seed(4))
    labels[doc_ids == 0] = -100
    valid = float((labels != -100).sum())
    loss_fn = LinearCrossEntropyLoss(512)
    configure_backends({op: entry.reference for op, entry in BACKEND_OPS.items()})
    cpu = build(seed=3)
    ref = loss_fn(cpu.output, cpu(tokens, pixel_values=pixels, grid_thws=grids, doc_ids=doc_ids, return_hidden=True),
                  labels, valid)
    gpu = build(seed=3).cuda()
    try:
        configure_backends({op: "auto" for op in BACKEND_OPS})
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = gpu(tokens.cuda(), pixel_values=pixels.cuda(), grid_thws=grids.cuda(), doc_ids=doc_ids.cuda(),
                         return_hidden=True)
            loss = loss_fn(gpu.output, hidden, labels.cuda(), valid)
        loss.backward()
    finally:
        configure_backends({op: entry.reference for op, entry in BACKEND_OPS.items()})
    assert abs(float(loss) - float(ref)) < 2e-2 * abs(float(ref))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.mm_projector.parameters())
