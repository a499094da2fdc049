"""The KDA short convolution op (``titan_kimi::short_conv``): its Triton kernels against the formula in fp64,
under the CPU interpreter at small shapes and (@pytest.mark.gpu) at k31.toml's KDA shape in bf16; the op's
autograd and the model's dispatch between the formula and the op."""

import importlib

import pytest
import torch

from conftest import backend_selected, pretend_selected
from lowerings.ops.registry import install_backends, resolved_backends
from test_triton_kernels import _interp_mods, ik, rel_err  # noqa: F401 (fixtures)

sc = importlib.import_module("lowerings.ops.short_conv")  # the module: lowerings.ops.short_conv is also its function


def segments(B: int, S: int, starts: list[list[int]], device="cpu") -> torch.Tensor:
    """pos_in_seg [B, S] int32 for segments starting at ``starts[b]`` (0 is always a start)."""
    pos = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        begin = 0
        for t in range(S):
            if t in starts[b]:
                begin = t
            pos[b, t] = t - begin
    return pos.to(device)


def reference_grads(x, w, pos, cot):
    """(y, dx, dw) of the formula in fp64."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = sc.short_conv_reference(x64, w64, pos)
    y.backward(cot.double())
    return y, x64.grad, w64.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_pos", [True, False])
def test_interpreted_kernels_match_the_formula(ik, dtype, tol, with_pos):
    # S and C not multiples of the tiles; segment starts inside a tile, at a tile edge and one token long
    B, S, C, W = 2, 45, 150, 4
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) * 0.5
    pos = segments(B, S, [[0, 5, 6, 32], [0, 17]]) if with_pos else None
    cot = torch.randn(B, S, C, generator=g).to(dtype)
    ref, dx_ref, dw_ref = reference_grads(x, w, pos, cot)

    y = ik.short_conv.short_conv_forward(x, w, pos)
    dx, dw = ik.short_conv.short_conv_backward(cot, x, w, pos)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    assert rel_err(y, ref) < tol and rel_err(dx, dx_ref) < tol and rel_err(dw, dw_ref) < max(tol, 1e-5)


@pytest.mark.parametrize("tiles", [(16, 64, 4), (64, 32, 2)])
def test_interpreted_kernels_other_tiles(ik, tiles):
    B, S, C, W = 1, 70, 100, 3  # rows over a tile boundary, a 3-tap window
    x, w = torch.randn(B, S, C), torch.randn(C, W)
    pos = segments(B, S, [[0, 15, 16, 40]])
    cot = torch.randn(B, S, C)
    ref, dx_ref, dw_ref = reference_grads(x, w, pos, cot)
    y = ik.short_conv.short_conv_forward(x, w, pos, tiles=tiles)
    dx, dw = ik.short_conv.short_conv_backward(cot, x, w, pos, tiles=tiles)
    assert rel_err(y, ref) < 1e-5 and rel_err(dx, dx_ref) < 1e-5 and rel_err(dw, dw_ref) < 1e-5


def test_interpreted_kernels_reset_the_window_at_segment_starts(ik):
    # a token's output must not change when the tokens of the previous segment do
    S, C, W = 12, 8, 4
    x = torch.randn(1, S, C)
    w = torch.randn(C, W)
    pos = segments(1, S, [[0, 6]])
    x2 = x.clone()
    x2[:, :6] = torch.randn(1, 6, C)
    y, y2 = (ik.short_conv.short_conv_forward(t, w, pos) for t in (x, x2))
    torch.testing.assert_close(y[:, 6:], y2[:, 6:], rtol=0, atol=0)
    assert not torch.allclose(y[:, :6], y2[:, :6])


def test_interpreted_kernels_reject_bad_inputs(ik):
    x, w = torch.randn(1, 8, 16), torch.randn(16, 4)
    with pytest.raises(ValueError, match="weight must be fp32"):
        ik.short_conv.short_conv_forward(x, w.double(), None)
    with pytest.raises(ValueError, match="pos must be"):
        ik.short_conv.short_conv_forward(x, w, torch.zeros(1, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="dy must match"):
        ik.short_conv.short_conv_backward(x[:, :4], x, w, None)


def test_op_autograd_matches_the_formula():
    # the custom op's reference body and its backward op, through autograd
    B, S, C, W = 2, 20, 12, 4
    x = torch.randn(B, S, C, requires_grad=True)
    w = torch.randn(C, W, requires_grad=True)
    pos = segments(B, S, [[0, 9], [0, 3, 4]])
    cot = torch.randn(B, S, C)
    ref, dx_ref, dw_ref = reference_grads(x.detach(), w.detach(), pos, cot)
    y = sc.short_conv_op(x, w, pos)
    y.backward(cot)
    assert rel_err(y, ref) < 1e-6 and rel_err(x.grad, dx_ref) < 1e-6 and rel_err(w.grad, dw_ref) < 1e-6


def test_op_passes_opcheck():
    x, w = torch.randn(1, 10, 8, requires_grad=True), torch.randn(8, 4, requires_grad=True)
    torch.library.opcheck(sc.short_conv_op, (x, w, segments(1, 10, [[0, 4]])))
    torch.library.opcheck(sc.short_conv_op, (x, w, None))


def test_wrapper_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="expected x \\[B,S,C\\]"):
        sc.short_conv(torch.randn(2, 8, 16), torch.randn(15, 4), None)


def test_reference_backend_and_cpu_run_the_formula_not_the_op(monkeypatch):
    calls = []
    monkeypatch.setattr(sc, "short_conv_op", lambda *a: calls.append(a))
    with backend_selected("short_conv", "reference"):
        sc.short_conv(torch.randn(1, 6, 8), torch.randn(8, 1, 4), None)
    pretend_selected(monkeypatch, "short_conv", "triton")  # triton selected, but the tensors are on the CPU
    sc.short_conv(torch.randn(1, 6, 8), torch.randn(8, 1, 4), None)
    assert calls == []


def test_compiled_regions_trace_the_formula_under_either_backend(monkeypatch):
    calls, graphs = [], []
    monkeypatch.setattr(sc, "short_conv_op", lambda *a: calls.append(a))
    monkeypatch.setattr(sc, "_use_triton", lambda x: True)  # a stand-in for a CUDA tensor with triton selected

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x, w = torch.randn(1, 6, 8), torch.randn(8, 1, 4)
    out = torch.compile(sc.short_conv, backend=capture, fullgraph=True)(x, w, None)
    assert calls == [] and len(graphs) == 1 and "short_conv" not in graphs[0]
    assert rel_err(out, sc.short_conv_reference(x, w.squeeze(1), None)) < 1e-6


def test_triton_backend_on_cuda_calls_the_op_with_the_squeezed_weight(monkeypatch):
    calls = []
    monkeypatch.setattr(sc, "short_conv_op", lambda x, w, pos: calls.append((x.shape, w.shape, pos)))
    monkeypatch.setattr(sc, "_use_triton", lambda x: True)  # a stand-in for a CUDA tensor with triton selected
    sc.short_conv(torch.randn(1, 6, 8), torch.randn(8, 1, 4), None)
    assert calls == [(torch.Size([1, 6, 8]), torch.Size([8, 4]), None)]


# ------------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("with_pos", [True, False])
def test_gpu_kernels_at_the_k31_kda_shape(with_pos):
    """One microbatch of k31.toml at a KDA layer: 4,096 tokens x 96 heads x 128 channels, bf16, 4 taps."""
    B, S, C, W = 1, 4096, 96 * 128, 4
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(B, S, C, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(C, W, device="cuda", generator=g) * 0.5
    pos = segments(B, S, [[0, 700, 1152, 1153]], device="cuda") if with_pos else None
    cot = torch.randn(B, S, C, device="cuda", generator=g).to(torch.bfloat16)
    ref, dx_ref, dw_ref = reference_grads(x, w, pos, cot)
    from lowerings.kernels.short_conv import short_conv_backward, short_conv_forward

    y = short_conv_forward(x, w, pos)
    dx, dw = short_conv_backward(cot, x, w, pos)
    assert rel_err(y, ref) < 1e-2 and rel_err(dx, dx_ref) < 1e-2 and rel_err(dw, dw_ref) < 1e-4


@pytest.mark.gpu
@gpu
def test_gpu_kda_layer_triton_backend_matches_reference_backend():
    """A KDA attention layer (k31_small width) forward and backward with short_conv = triton vs reference, eager
    (inside a compiled region both backends trace the formula)."""
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.models.kimi_k3.delta_attention import KimiDeltaAttention
    from titan_kimi.models.kimi_k3.sequence import build_sequence_info

    args = model_args_for("k31_small")
    torch.manual_seed(0)
    layer = KimiDeltaAttention(args).cuda()
    layer.init_weights()
    layer = layer.to(torch.bfloat16)
    for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
        conv.weight.data = conv.weight.data.float()
    x = torch.randn(1, 2048, args.dim, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.zeros(1, 2048, dtype=torch.long, device="cuda")
    doc_ids[:, 900:] = 1
    seq = build_sequence_info(1, 2048, x.device, doc_ids)
    saved = resolved_backends()
    results = {}
    try:
        for backend in ("reference", "triton"):
            install_backends(saved.replaced({"short_conv": backend}))
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            out = layer(xi, seq)
            out.float().square().mean().backward()
            results[backend] = (out, xi.grad, layer.q_conv1d.weight.grad.clone())
    finally:
        install_backends(saved)
    for a, b in zip(results["triton"], results["reference"]):
        assert rel_err(a, b) < 1e-2
