"""training.routed_expert_gemm: the routed experts' grouped GEMMs in the compute dtype or in FP8 (torchao's
row-wise scaled grouped GEMM). CPU: the key's checks and where it lands; @pytest.mark.gpu: FP8 against the bf16
GEMMs and an fp32 truth on fresh random inputs, forward and backward, with empty and uneven expert groups."""

import pytest
import torch

from lowerings.ops.expert_gemm import PRECISIONS, fp8_unavailable_reason, grouped_mm, row_alignment
from titan_kimi.config import load_job_config
from titan_kimi.config.errors import ConfigError
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import GroupedExperts, LatentMoE, _aligned_for_grouped_mm, set_routed_expert_gemm


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_precisions_and_their_row_alignment():
    assert PRECISIONS == ("default", "fp8_rowwise")
    import dataclasses

    from titan_kimi.config.sections import Training

    key = {f.name: f for f in dataclasses.fields(Training)}["routed_expert_gemm"]
    assert key.metadata["choices"] == PRECISIONS  # the config (torch-free) lists the same precisions
    assert (row_alignment("default"), row_alignment("fp8_rowwise")) == (8, 16)
    with pytest.raises(ValueError, match="'fp4'"):
        row_alignment("fp4")
    with pytest.raises(ValueError, match="'fp4'"):
        grouped_mm(torch.randn(4, 16), torch.randn(1, 16, 16), torch.tensor([4], dtype=torch.int32), "fp4")


def test_the_key_reaches_every_expert_module_of_the_model():
    moe = LatentMoE(model_args_for("k3_debug"))
    assert moe.experts.gemm_precision == "default"
    assert set_routed_expert_gemm(moe, "fp8_rowwise") == 1
    assert moe.experts.gemm_precision == "fp8_rowwise"
    assert GroupedExperts.gemm_precision == "default"  # the instance changed, not the class
    with pytest.raises(ValueError, match="'half'"):
        set_routed_expert_gemm(moe, "half")


def test_the_ep_alignment_follows_the_precision():
    """Under expert parallelism the permutation pads received rows to torchtitan's process-wide alignment:
    applying the model's AC and compile settings with fp8_rowwise sets it to 16."""
    import torchtitan.models.moe.utils as moe_utils

    from titan_kimi.parallel.parallelize import _ac_and_compile

    cfg = load_job_config(["--job.config_file", "train_configs/k31_debug.toml", "--training.routed_expert_gemm",
                           "fp8_rowwise", "--compile.mode", "none", "--activation_checkpoint.mode", "none"])
    model = LatentMoE(model_args_for("k3_debug"))
    model.layers = {}
    try:
        _ac_and_compile(model, cfg, experts_outside=True)
        assert moe_utils.TOKEN_GROUP_ALIGN_SIZE_M == 16 and model.experts.gemm_precision == "fp8_rowwise"
    finally:
        moe_utils.set_token_group_alignment_size_m(8)


def test_fp8_is_refused_where_it_cannot_run():
    from titan_kimi.training.setup.kernels import check_routed_expert_gemm

    check_routed_expert_gemm("default", torch.device("cpu"))
    assert "CUDA" in fp8_unavailable_reason(torch.device("cpu"))
    with pytest.raises(ValueError, match="routed_expert_gemm = 'fp8_rowwise' cannot run here.*valid here: 'default'"):
        check_routed_expert_gemm("fp8_rowwise", torch.device("cpu"))


def test_the_config_refuses_fp8_with_adapters_and_unknown_values():
    with pytest.raises(ConfigError, match="lora.enable"):
        load_job_config(["--job.config_file", "train_configs/k31_debug.toml", "--training.routed_expert_gemm",
                         "fp8_rowwise", "--lora.enable", "true"])
    with pytest.raises(ConfigError, match="fp16"):
        load_job_config(["--job.config_file", "train_configs/k31_debug.toml", "--training.routed_expert_gemm", "fp16"])


# ------------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                         reason="needs an sm89+ GPU")


@pytest.mark.gpu
@gpu
def test_gpu_fp8_experts_against_bf16_and_fp32():
    """28 experts (one k31.toml EP rank) at a reduced width, uneven groups with empty ones: the FP8 grouped GEMMs'
    output and gradients against an fp32 truth, beside the bf16 GEMMs' own error."""
    torch.manual_seed(0)
    E, L, F = 28, 512, 384
    experts = GroupedExperts(E, L, F, 4.0, 25.0, 0.02).cuda()
    experts.init_weights()
    counts = torch.randint(0, 200, (E,), device="cuda")
    counts[[3, 11]] = 0
    x = torch.randn(int(counts.sum()), L, device="cuda")
    cot = torch.randn(x.shape[0], L, device="cuda")
    results = {}
    # the fp32 truth on the CPU (CUDA's grouped GEMM takes bf16), the bf16 and FP8 GEMMs on the GPU
    for name, precision, device, dtype in (("fp32", "default", "cpu", torch.float32),
                                           ("bf16", "default", "cuda", torch.bfloat16),
                                           ("fp8", "fp8_rowwise", "cuda", torch.bfloat16)):
        experts.gemm_precision = precision
        xi = x.to(device, dtype).requires_grad_()
        w13 = experts.w13.detach().to(device, dtype).requires_grad_()
        w2 = experts.w2.detach().to(device, dtype).requires_grad_()
        if device == "cpu":
            out = experts.run(w13, w2, xi, counts.cpu())
        else:
            out = _aligned_for_grouped_mm(experts.run, w13, w2, xi, counts, align=row_alignment(precision))
        out.backward(cot.to(device, dtype))
        results[name] = tuple(t.float().cpu() for t in (out, xi.grad, w13.grad, w2.grad))
    truth = results["fp32"]
    bf16_err = [rel_err(a, b) for a, b in zip(results["bf16"], truth)]
    fp8_err = [rel_err(a, b) for a, b in zip(results["fp8"], truth)]
    print("bf16 errors", bf16_err, "fp8 errors", fp8_err)
    assert max(bf16_err) < 1e-2
    assert max(fp8_err) < 8e-2, fp8_err  # e4m3 keeps 3 mantissa bits: ~4% per element, averaged in the sums


@pytest.mark.gpu
@gpu
def test_gpu_latent_moe_in_fp8_tracks_bf16():
    """The whole LatentMoE in bf16 with FP8 expert GEMMs against the same layer with bf16 ones."""
    torch.manual_seed(1)
    args = model_args_for("k3_debug", num_experts=16, moe_inter_dim=256, moe_latent_dim=256)
    moe = LatentMoE(args).cuda()
    moe.init_weights()
    moe = moe.to(torch.bfloat16)
    moe.router.float()
    x = torch.randn(2, 512, args.dim, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn_like(x)
    outs = {}
    for precision in PRECISIONS:
        set_routed_expert_gemm(moe, precision)
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.backward(cot)
        outs[precision] = (out, xi.grad, moe.experts.w13.grad, moe.experts.w2.grad)
    errors = [rel_err(a, b) for a, b in zip(outs["fp8_rowwise"], outs["default"])]
    print("fp8 vs bf16", errors)
    assert max(errors) < 8e-2, errors
