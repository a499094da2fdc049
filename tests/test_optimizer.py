"""The multi-tensor Adam against the per-parameter reference, the implementation chosen per dtype setting, and
its checkpoint state."""

import pytest
import torch

from titan_kimi.config.sections import Optimizer
from titan_kimi.models.kimi_k3.flavors import model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype, fp32_parameter_names
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.training.optim.adam_multi_tensor import MultiTensorAdam
from titan_kimi.training.optim.adam_reference import AdamWithStateDtype
from titan_kimi.training.optim.optimizer import build_optimizer

SHAPES = [(7, 5), (33,), (4, 3, 2), (1,), (64, 16)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(param_dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(param_dtype)) for s in SHAPES]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(cls, param_dtype, state_dtype, decoupled, steps=5, **kwargs):
    params = make_params(param_dtype)
    opt = cls(params, **HYPER, decoupled=decoupled, state_dtype=state_dtype, **kwargs)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return params, opt


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("param_dtype, state_dtype, rel", [
    (torch.float32, torch.float32, 1e-6),
    (torch.float32, torch.bfloat16, 1e-2),
    (torch.bfloat16, torch.float32, 1e-2),
    (torch.bfloat16, torch.bfloat16, 1e-2),
])
def test_multi_tensor_adam_matches_the_per_parameter_reference(decoupled, param_dtype, state_dtype, rel):
    # chunk_numel=100 splits the parameters over several chunks, as large models are
    new, new_opt = run(MultiTensorAdam, param_dtype, state_dtype, decoupled, chunk_numel=100)
    ref, ref_opt = run(AdamWithStateDtype, param_dtype, state_dtype, decoupled)
    start = make_params(param_dtype)
    for a, b, p0 in zip(new, ref, start):
        assert a.dtype == param_dtype
        moved = (b.float() - p0.float()).abs().max()
        assert moved > 1e-3  # the steps did move the weights
        torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=rel * moved.item())
    for a, b in zip(new, ref):
        sa, sb = new_opt.state[a], ref_opt.state[b]
        assert sa["exp_avg"].dtype == sb["exp_avg"].dtype == state_dtype
        assert sa["step"].item() == sb["step"].item() == 5
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key].float(), sb[key].float(), rtol=rel, atol=rel * sb[key].float().abs().max().item())


def test_multi_tensor_adam_reads_no_tensor_value_on_the_host(monkeypatch):
    params = make_params(torch.float32)
    opt = MultiTensorAdam(params, **HYPER, decoupled=True, state_dtype=torch.bfloat16)
    set_grads(params, 0)
    opt.step()  # the first step creates the state

    def refuse(self):
        raise AssertionError(".item() called in the optimizer step")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    set_grads(params, 1)
    opt.step()
    monkeypatch.undo()
    assert all(opt.state[p]["step"].item() == 2 for p in params)


def test_parameters_without_gradients_keep_their_state_and_step():
    params = make_params(torch.float32)
    opt = MultiTensorAdam(params, **HYPER, decoupled=True, state_dtype=torch.bfloat16)
    set_grads(params, 0)
    opt.step()
    params[1].grad = None
    before = params[1].detach().clone()
    set_grads([params[0]], 1)
    opt.step()
    assert torch.equal(params[1], before) and opt.state[params[1]]["step"].item() == 1
    assert opt.state[params[0]]["step"].item() == 2


def tiny_model(model_dtype: torch.dtype) -> KimiK3Model:
    torch.manual_seed(0)
    model = cast_model_dtype(KimiK3Model(model_args_for("k3_debug", n_layers=4)), model_dtype)
    model.init_weights()
    return model


@pytest.mark.parametrize("model_dtype, state_dtype, expected", [
    ("float32", "float32", torch.optim.AdamW),
    ("bfloat16", "bfloat16", torch.optim.AdamW),  # the fp32-by-design parameters do not force another path
    ("float32", "bfloat16", MultiTensorAdam),
    ("bfloat16", "float32", MultiTensorAdam),
])
def test_implementation_chosen_per_dtype_setting(model_dtype, state_dtype, expected):
    from titan_kimi.dtypes import DTYPES

    model = tiny_model(DTYPES[model_dtype])
    opt = build_optimizer([model], Optimizer(state_dtype=state_dtype))
    assert type(opt) is expected
    if expected is torch.optim.AdamW:
        assert opt.defaults["fused"]  # one multi-tensor kernel per step on CUDA (and on CPU)
    model(torch.randint(0, 2048, (2, 8))).float().square().mean().backward()
    opt.step()
    keep = fp32_parameter_names(model)
    assert keep, "the model has fp32-by-design parameters"
    for name, p in model.named_parameters():
        if p.grad is not None:
            want = torch.float32 if name in keep else DTYPES[state_dtype]
            assert opt.state[p]["exp_avg"].dtype == want, name


def test_state_dict_round_trip_resumes_exactly():
    params, opt = run(MultiTensorAdam, torch.float32, torch.bfloat16, decoupled=True, steps=3)
    saved = opt.state_dict()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = MultiTensorAdam(copies, **HYPER, decoupled=True, state_dtype=torch.bfloat16)
    other.load_state_dict(saved)
    assert all(other.state[p]["exp_avg"].dtype == torch.bfloat16 for p in copies)
    for step in (3, 4):
        set_grads(params, step)
        set_grads(copies, step)
        opt.step()
        other.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies))


def test_reference_checkpoint_state_loads_into_the_multi_tensor_adam():
    """Same state layout (step, exp_avg, exp_avg_sq; state_dtype in the groups): checkpoints of the per-parameter
    Adam resume here."""
    ref_params, ref = run(AdamWithStateDtype, torch.bfloat16, torch.float32, decoupled=False, steps=3)
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    new = MultiTensorAdam(params, **HYPER, decoupled=False, state_dtype=torch.float32)
    new.load_state_dict(ref.state_dict())
    set_grads(ref_params, 3)
    set_grads(params, 3)
    ref.step()
    new.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype, state_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_multi_tensor_adam_on_cuda_matches_the_reference(param_dtype, state_dtype):
    """The CUDA multi-tensor kernels (cross-dtype _foreach_copy_, scalar-list div/addcdiv) against the reference."""
    def run_on(cls, **kwargs):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(param_dtype)]
        opt = cls(params, **HYPER, decoupled=True, state_dtype=state_dtype, **kwargs)
        for step in range(5):
            host = make_params(param_dtype)
            set_grads(host, step)  # the CPU tests' gradients, moved
            for p, h in zip(params, host):
                p.grad = h.grad.cuda()
            opt.step()
        return params

    new, ref = run_on(MultiTensorAdam, chunk_numel=100), run_on(AdamWithStateDtype)
    for a, b in zip(new, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)
