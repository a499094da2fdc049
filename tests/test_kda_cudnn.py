"""The cudnn kda backend without a GPU: the availability check, config validation, the metadata checks, the
preprocessing chain rule, and the adapter's plumbing around stand-in cuDNN kernels (the pure-torch reference)."""

import importlib.util
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lowerings import ops
from lowerings.kernels import cudnn_kda
from lowerings.ops.kda import BACKENDS
from lowerings.ops.kda_reference import kda_gate, kda_reference
from lowerings.ops.registry import configure_backends, plan_as_cuda, resolved_backends, selected_backend
from conftest import pretend_selected

K = 128
SCALE = K**-0.5
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(B, T, H, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, H, K).to(dtype),
                u=r(B, T, H, K).to(dtype), beta=torch.rand(B, T, H, generator=gen),
                A_log=torch.empty(H).uniform_(1, 16, generator=gen).log(), dt_bias=r(H * K) * 0.1)


@no_cuda
def test_availability_says_why_on_cpu(monkeypatch):
    assert BACKENDS.checks["cudnn"]() == "no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    assert "needs compute capability 9.0" in cudnn_kda.unavailable_reason()
    assert "has 8.0" in cudnn_kda.unavailable_reason()
    if importlib.util.find_spec("cudnn") is None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        assert "'cudnn' (nvidia-cudnn-frontend==1.32.0) is not installed" in cudnn_kda.unavailable_reason()


@no_cuda
def test_config_rejects_cudnn_on_cpu():
    from titan_kimi.config import load_job_config
    from titan_kimi.training.setup.kernels import configure_kernels
    from titan_kimi.training.setup.build import model_args_from_config

    before = selected_backend("kda")
    cfg = load_job_config(["--kernels.kda", "cudnn"], environ={})
    with pytest.raises(ValueError, match=r"kernels.kda = 'cudnn' is not available on this machine: no CUDA device"):
        configure_kernels(cfg.kernels, model_args_from_config(cfg))
    assert selected_backend("kda") == before
    assert configure_backends({"kda": "auto"})["kda"] == "reference"  # auto never picks cudnn (not ranked yet)


def _call_args(x, **over):
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["u"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                lower_bound=-5.0, scale=SCALE, cu_seqlens=None, initial_state=None, output_final_state=False,
                l2norm_qk=True)
    args.update(over)
    return args


def test_check_supported_names_what_the_engine_cannot_run():
    x = inputs(1, 8, 2, seed=0)
    cudnn_kda.check_supported(**_call_args(x))
    cudnn_kda.check_supported(**_call_args(x, lower_bound=None, dt_bias=None))
    small = inputs(1, 8, 2, seed=0)
    small["q"], small["k"] = small["q"][..., :64], small["k"][..., :64]
    cases = [
        (_call_args(small), r"head dims K=64, V=128"),
        (_call_args(x, scale=0.1), r"scale=0.1 \(the backward kernel bakes in 1/sqrt\(128\)"),
        (_call_args(x, initial_state=torch.zeros(1, 2, K, K)), "initial_state given"),
        (_call_args(x, output_final_state=True), "output_final_state=True"),
        (_call_args(x, l2norm_qk=False), "l2norm_qk=False"),
        (_call_args(x, A_log=None), "A_log=None"),
        (_call_args(x, q=x["q"].float(), v=x["v"].half()), r"q torch.float32, v torch.float16 \(the kernels' io dtype"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=r"kernels.kda = 'cudnn' cannot run this call: .*" + message):
            cudnn_kda.check_supported(**args)


def test_fake_under_plan_as_cuda_keeps_no_residuals_and_checks_at_trace_time():
    x = inputs(1, 16, 2, seed=1)
    args = list(_call_args(x).values())
    with FakeTensorMode() as mode, plan_as_cuda(resolved_backends().replaced({"kda": "cudnn"})):
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        o, final, residuals = torch.ops.titan_kimi.kda.default(*fake)
        assert o.shape == x["v"].shape and final.shape == (0,) and residuals == []
        fake[8] = 0.5  # scale
        with pytest.raises(ValueError, match="scale=0.5"):
            torch.ops.titan_kimi.kda.default(*fake)


@pytest.mark.parametrize("lower_bound, with_bias", [(-5.0, True), (None, True), (-5.0, False)])
def test_preprocessing_chain_rule_matches_autograd(lower_bound, with_bias):
    x = inputs(2, 24, 3, seed=2, dtype=torch.float32)
    x["u"] = x["u"] * 2
    dt_bias = x["dt_bias"] if with_bias else None
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "u", "A_log", "dt_bias")}
    bias = leaves["dt_bias"] if with_bias else None
    prep = cudnn_kda.preprocess(leaves["q"], leaves["k"], leaves["u"], x["beta"], leaves["A_log"], bias, lower_bound)
    assert torch.allclose(prep.q_n.norm(dim=-1), torch.ones(2, 24, 3), atol=1e-5)
    assert torch.allclose(prep.g, kda_gate(x["u"], x["A_log"], dt_bias, lower_bound), atol=1e-6)
    gen = torch.Generator().manual_seed(3)
    cot = [torch.randn(t.shape, generator=gen) for t in (prep.q_n, prep.k_n, prep.g)]
    wrt = [leaves[n] for n in ("q", "k", "u", "A_log")] + ([bias] if with_bias else [])
    expected = torch.autograd.grad((prep.q_n, prep.k_n, prep.g), wrt, cot)
    detached = cudnn_kda.Prepared(*(t.detach() for t in prep))
    got = cudnn_kda.preprocess_vjp(detached, x["u"], x["A_log"], dt_bias, lower_bound, *cot)
    got = [g for g in got if g is not None]
    assert len(got) == len(expected)
    for name, a, b in zip(["q", "k", "u", "A_log", "dt_bias"], got, expected):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.skipif(importlib.util.find_spec("fla") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's Triton kernels in the CPU interpreter (GPU runs check them against the reference)")
def test_fla_preprocessing_kernels_match_the_torch_ones(monkeypatch):
    """On CUDA the adapter uses FLA's fused l2norm and gate kernels; here they run in the Triton interpreter
    (autotuning stubbed out) against the torch versions the chain-rule test checks."""
    import triton.runtime.autotuner as autotuner

    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, **kw: [1.0, 1.0, 1.0])
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.kda.gate import kda_gate_bwd, kda_gate_fwd

    x = inputs(1, 40, 2, seed=4, dtype=torch.float32)
    y, rstd = l2norm_fwd(x["q"], eps=1e-6)
    y_t, rstd_t = cudnn_kda.l2norm_fwd_torch(x["q"])
    assert rel_err(y, y_t) < 1e-6 and rel_err(rstd, rstd_t) < 1e-6
    dy = torch.randn_like(y)
    assert rel_err(l2norm_bwd(y, rstd, dy, eps=1e-6), cudnn_kda.l2norm_bwd_torch(y_t, rstd_t, dy)) < 1e-6
    for lb in (-5.0, None):
        g = kda_gate_fwd(x["u"], x["A_log"], x["dt_bias"], lb, output_dtype=torch.float32)
        assert g.dtype == torch.float32 and rel_err(g, kda_gate(x["u"], x["A_log"], x["dt_bias"], lb)) < 1e-6
        dg = torch.randn_like(g)
        fla = kda_gate_bwd(x["u"], x["A_log"], x["dt_bias"], dyg=dg, lower_bound=lb)
        ours = cudnn_kda.gate_bwd_torch(x["u"], x["A_log"], x["dt_bias"], dg, lb)
        for a, b in zip(fla, ours):
            assert a.dtype == b.dtype and rel_err(a, b) < 1e-5


class StandInKernels:
    """cuDNN-FE's run_kda_fwd / kda_bwd contract, computed by the reference on what the adapter hands over."""

    def __init__(self):
        self.calls = []

    def _check(self, q, k, v, g, beta, cu, scale, plan_name):
        total, H, D = q.shape
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and g.dtype == beta.dtype == torch.float32
        assert k.shape == v.shape == g.shape == (total, H, D) and beta.shape == (total, H)
        assert cu.dtype == torch.int32 and int(cu[-1]) == total and plan_name == cudnn_kda.PLAN
        assert torch.allclose(q.float().norm(dim=-1), torch.ones(total, H), atol=1e-2)  # pre-normalised
        assert scale == SCALE and (g <= 0).all()
        self.calls.append(cu.tolist())

    @staticmethod
    def _reference(q, k, v, g, beta, cu, scale):
        o, _ = kda_reference(q[None].float(), k[None].float(), v[None].float(), g[None], beta[None], None, None,
                             None, scale, cu, None, False, False)
        return o[0]

    def forward(self, *, q, k, v, g, beta, cu_seqlens, scale, output_final_state, plan_name):
        self._check(q, k, v, g, beta, cu_seqlens, scale, plan_name)
        assert not output_final_state
        o = self._reference(q, k, v, g, beta, cu_seqlens, scale).to(q.dtype)
        return o, q.new_empty(0, dtype=torch.float32), q.new_empty(0)

    def backward(self, dO, q, k, v, g, beta, cu_seqlens, scale, *, plan_name):
        self._check(q, k, v, g, beta, cu_seqlens, scale, plan_name)
        _, vjp = torch.func.vjp(lambda *xs: self._reference(*xs, cu_seqlens, scale),  # works below autograd too
                                *(t.float() for t in (q, k, v, g, beta)))
        dq, dk, dv, dg, db = vjp(dO.float())
        empty = q.new_empty(0, dtype=torch.float32)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dg, db, empty, empty, empty


@pytest.mark.parametrize("layout", ["dense_batch2", "varlen_zero_tail"])
def test_adapter_matches_the_reference_around_stand_in_kernels(monkeypatch, layout):
    """Layout (THD, a dense batch as B sequences, zero-length tail segments passed through), the preprocessing,
    the gradient order and dtypes of the op's contract: against the reference op with autograd."""
    stand_in = StandInKernels()
    monkeypatch.setattr(cudnn_kda, "_cudnn_kernels", lambda: (stand_in.forward, stand_in.backward))
    B, T, H = (2, 40, 2) if layout == "dense_batch2" else (1, 80, 2)
    cu = None if B == 2 else torch.tensor([0, 10, 33, 80, 80, 80], dtype=torch.int32)
    x = inputs(B, T, H, seed=5)
    names = ["q", "k", "v", "u", "beta", "A_log", "dt_bias"]
    args = lambda xs: (xs["q"], xs["k"], xs["v"], xs["u"], xs["beta"], xs["A_log"], xs["dt_bias"], -5.0, SCALE,
                       cu, None, False, True)
    o, final, residuals = cudnn_kda.cudnn_kda_forward(*args(x))
    assert o.shape == x["v"].shape and o.dtype == torch.bfloat16 and final.shape == (0,) and residuals == []
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(6)).to(o.dtype)
    grads = cudnn_kda.cudnn_kda_backward(d_o, final, *args(x), residuals)
    assert stand_in.calls[0] == ([0, T, 2 * T] if cu is None else cu.tolist())

    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    o_ref, _ = kda_reference(*args(leaves))
    expected = torch.autograd.grad(o_ref, [leaves[n] for n in names], d_o)
    assert rel_err(o, o_ref) < 1e-2
    assert len(grads) == len(expected)
    for name, a, b in zip(names, grads, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 2e-2, name


def test_cpu_tensors_never_reach_cudnn_when_it_is_selected(monkeypatch):
    """The cudnn branch is for CUDA tensors only (like fla): with cudnn selected, a CPU call runs the reference."""
    monkeypatch.setattr(cudnn_kda, "_cudnn_kernels", lambda: pytest.fail("a CPU call reached the cuDNN kernels"))
    pretend_selected(monkeypatch, "kda", "cudnn")  # past the availability check, as on a GPU
    x = inputs(1, 20, 2, seed=7)
    kw = dict(scale=SCALE, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0)
    o, _ = ops.kda(x["q"], x["k"], x["v"], x["u"], x["beta"], **kw)
    o_ref, _ = kda_reference(x["q"], x["k"], x["v"], x["u"], x["beta"], x["A_log"], x["dt_bias"], -5.0, SCALE,
                             None, None, False, True)
    assert torch.equal(o, o_ref)


def test_the_op_routes_cuda_calls_to_the_adapter_eager_and_compiled(monkeypatch):
    """kda.py's cudnn branches (forward, fake, backward op) around the stand-in kernels, CPU tensors taken for
    CUDA ones: eager against the reference op, and compiled (the fake: no residuals) against eager."""
    kda_module = importlib.import_module("lowerings.ops.kda")
    stand_in = StandInKernels()
    monkeypatch.setattr(cudnn_kda, "_cudnn_kernels", lambda: (stand_in.forward, stand_in.backward))
    monkeypatch.setattr(kda_module, "on_cuda", lambda t: True)
    pretend_selected(monkeypatch, "kda", "cudnn")
    x = inputs(1, 64, 2, seed=8)
    names = ["q", "k", "v", "u", "beta", "A_log", "dt_bias"]
    cu = torch.tensor([0, 10, 64, 64], dtype=torch.int32)
    d_o = torch.randn(1, 64, 2, K, generator=torch.Generator().manual_seed(9)).bfloat16()

    def fwd(*xs):
        return ops.kda(*xs[:5], scale=SCALE, A_log=xs[5], dt_bias=xs[6], lower_bound=-5.0, cu_seqlens=cu)[0]

    def run(fn):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o = fn(*leaves)
        o.backward(d_o)
        return o.detach(), [t.grad for t in leaves]

    o, grads = run(fwd)
    assert len(stand_in.calls) == 2  # forward and backward reached the kernels
    o_c, grads_c = run(torch.compile(fwd, backend="aot_eager", fullgraph=True))
    pretend_selected(monkeypatch, "kda", "reference")
    o_ref, grads_ref = run(fwd)
    assert rel_err(o, o_ref) < 1e-2 and torch.equal(o_c, o)
    for name, a, b, c in zip(names, grads, grads_ref, grads_c):
        assert rel_err(a, b) < 2e-2 and torch.equal(a, c), name


def test_cudnn_is_refused_until_its_gradients_pass_on_the_gpu(monkeypatch):
    """Where the machine could run it, the backend is still refused, naming the measured gradient error, until
    tests/test_kda_cudnn_gpu.py passes (NUMERICS_VALIDATED)."""
    from lowerings.kernels import cudnn_kda

    monkeypatch.setattr(cudnn_kda, "machine_reason", lambda: None)
    assert "2.9e-2" in cudnn_kda.unavailable_reason() and "use kda = fla" in cudnn_kda.unavailable_reason()
    monkeypatch.setattr(cudnn_kda, "NUMERICS_VALIDATED", True)
    assert cudnn_kda.unavailable_reason() is None


def test_context_parallelism_refuses_the_cudnn_kda_backend():
    """The cudnn backend has no context-parallel path: the config says so before training instead of CP falling
    back to the fp32 reference."""
    from titan_kimi.config import ConfigError, load_job_config

    with pytest.raises(ConfigError, match=r'kernels.kda = "cudnn".*no context-parallel path.*valid: fla'):
        load_job_config(["--parallelism.context_parallel_degree", "2", "--kernels.kda", "cudnn"], environ={})
    assert load_job_config(["--parallelism.context_parallel_degree", "2"], environ={}).kernels.kda == "auto"
