"""titan_kimi::linear_cross_entropy on CPU: the op against the plain full-logits cross-entropy, its no-grad path,
its registration (opcheck, compile without graph breaks) and the backend selection (kernels.linear_cross_entropy)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lowerings import ops
from lowerings.ops.linear_cross_entropy_reference import linear_cross_entropy_reference
from lowerings.ops.registry import configure_backends, selected_backend
from titan_kimi.config import load_job_config

T, H, V = 37, 24, 101  # distinct sizes so that a [V, H] buffer is recognisable by shape


def _inputs(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) / H**0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.randperm(T, generator=g)[:9]] = ops.IGNORE_INDEX
    return hidden, weight, labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _full_ce(hidden, weight, labels, normalizer):
    return F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction="sum") / normalizer


@pytest.mark.parametrize("chunk", [1, 8, 512])
def test_matches_full_cross_entropy_forward_and_grads(chunk):
    hidden, weight, labels = _inputs(chunk)
    normalizer = 53.0  # the step's valid tokens (all ranks), not this batch's 28
    loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=normalizer, chunk_size=chunk)
    ref = _full_ce(hidden, weight, labels, normalizer)
    assert _rel(loss, ref) < 1e-5
    grads = torch.autograd.grad(3.0 * loss, [hidden, weight])
    ref_grads = torch.autograd.grad(3.0 * ref, [hidden, weight])
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 1e-5


def test_ignored_rows_get_no_gradient_and_all_ignored_is_zero():
    hidden, weight, labels = _inputs(1)
    loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=10.0)
    (d_hidden,) = torch.autograd.grad(loss, [hidden])
    ignored = labels == ops.IGNORE_INDEX
    assert d_hidden[ignored].abs().max() == 0 and d_hidden[~ignored].abs().min() > 0
    everything_ignored = torch.full_like(labels, ops.IGNORE_INDEX)
    loss = ops.linear_cross_entropy(hidden, weight, everything_ignored, normalizer=0)  # normaliser clamps to 1
    d_hidden, d_weight = torch.autograd.grad(loss, [hidden, weight])
    assert loss.item() == 0.0 and d_hidden.abs().sum() == 0 and d_weight.abs().sum() == 0


def test_batched_shapes_and_bad_arguments():
    hidden, weight, labels = _inputs(2)
    loss = ops.linear_cross_entropy(hidden[:36].reshape(4, 9, H), weight, labels[:36].reshape(4, 9), normalizer=7.0)
    assert _rel(loss, _full_ce(hidden[:36], weight, labels[:36], 7.0)) < 1e-5
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_cross_entropy(hidden, weight, labels, normalizer=1, chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        ops.linear_cross_entropy(hidden, weight, labels[:3], normalizer=1)
    with pytest.raises(ValueError, match="hidden size"):
        ops.linear_cross_entropy(hidden, weight[:, :5], labels, normalizer=1)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_grad_computes_only_the_loss():
    hidden, weight, labels = _inputs(3)
    with torch.no_grad():
        with _Shapes() as seen:
            loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=5.0)
    assert loss.grad_fn is None and (V, H) not in seen.shapes  # ([T, H] shows up: the flattening view of hidden)
    assert _rel(loss, _full_ce(hidden, weight, labels, 5.0).detach()) < 1e-5
    h, w = hidden.detach(), weight.detach()
    with _Shapes() as seen:  # the reference math itself, op by op: no [V, H] or [T, H] gradient buffer
        linear_cross_entropy_reference(h, w, labels, 8, False, False)
    assert (V, H) not in seen.shapes and (T, H) not in seen.shapes


def test_frozen_head_gets_no_weight_gradient_buffer():
    hidden, weight, labels = _inputs(4)
    weight.requires_grad_(False)
    with _Shapes() as seen:
        loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=5.0)
    assert (V, H) not in seen.shapes  # the op's outputs: loss, d_hidden [T, H] and an empty d_weight
    (d_hidden,) = torch.autograd.grad(loss, [hidden])
    ref = _full_ce(hidden, weight, labels, 5.0)
    assert _rel(d_hidden, torch.autograd.grad(ref, [hidden])[0]) < 1e-5


def test_op_runs_outside_cuda_graphs():
    # the fused backends sync with the host: reduce-overhead must partition the graph around the op
    assert torch._C.Tag.cudagraph_unsafe in torch.ops.titan_kimi.linear_cross_entropy.default.tags


def test_opcheck():
    hidden, weight, labels = _inputs(5)
    for grad_hidden, grad_weight in [(True, True), (True, False), (False, False)]:
        torch.library.opcheck(torch.ops.titan_kimi.linear_cross_entropy.default,
                              (hidden, weight, labels, 8, grad_hidden, grad_weight))


def test_compiles_fullgraph_forward_and_backward():
    hidden, weight, labels = _inputs(6)
    normalizer = torch.tensor(31.0)

    def step(h, w, y, n):
        return ops.linear_cross_entropy(h, w, y, normalizer=n, chunk_size=16) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    loss = compiled(hidden, weight, labels, normalizer)
    grads = torch.autograd.grad(loss, [hidden, weight])
    ref = 2.0 * _full_ce(hidden, weight, labels, normalizer)
    assert _rel(loss, ref) < 1e-5
    for got, want in zip(grads, torch.autograd.grad(ref, [hidden, weight])):
        assert _rel(got, want) < 1e-5
    explained = torch._dynamo.explain(step)(hidden, weight, labels, normalizer)
    assert explained.graph_break_count == 0


def test_backend_selection_on_cpu(caplog):
    before = selected_backend("linear_cross_entropy")
    with pytest.raises(ValueError, match=r"'cutlass'.*valid: \['auto', 'reference', 'liger'\]"):
        configure_backends({"linear_cross_entropy": "cutlass"})
    if not torch.cuda.is_available():
        for name in ("liger",):
            with pytest.raises(ValueError, match="no CUDA device"):
                configure_backends({"linear_cross_entropy": name})
        with caplog.at_level(logging.INFO, logger="lowerings.ops.registry"):
            assert configure_backends({"linear_cross_entropy": "auto"}) == {"linear_cross_entropy": "reference"}
        lines = [r.getMessage() for r in caplog.records if "linear_cross_entropy" in r.getMessage()]
        assert len(lines) == 1 and "auto -> reference" in lines[0] and "liger: no CUDA device" in lines[0]
    configure_backends({"linear_cross_entropy": before})


def test_config_key_rejects_unknown_backend():
    cfg = load_job_config(["--kernels.linear_cross_entropy", "liger"], environ={})
    assert cfg.kernels.linear_cross_entropy == "liger"
    with pytest.raises(ValueError, match="kernels.linear_cross_entropy.*cutlass"):
        load_job_config(["--kernels.linear_cross_entropy", "cutlass"], environ={})


def test_head_and_loss_use_the_op():
    from titan_kimi.models.kimi_k3.head import LMHead
    from titan_kimi.training.loss import LinearCrossEntropyLoss

    hidden, weight, labels = _inputs(7)
    head = LMHead(H, V)
    with torch.no_grad():
        head.weight.copy_(weight)
    loss = LinearCrossEntropyLoss(chunk_size=5)(head, hidden.unsqueeze(0), labels.unsqueeze(0), 40)
    ref = _full_ce(hidden, weight, labels, 40.0)
    assert _rel(loss, ref) < 1e-5
    loss.backward()
    assert _rel(head.weight.grad, torch.autograd.grad(ref, [weight])[0]) < 1e-5


def test_auto_falls_back_past_a_missing_package_with_one_log_line(monkeypatch, caplog):
    from lowerings.ops.linear_cross_entropy import BACKENDS

    # As on a GPU machine without liger-kernel.
    monkeypatch.setitem(BACKENDS.checks, "liger", lambda: "python module 'liger_kernel' is not installed")
    before = selected_backend("linear_cross_entropy")
    with caplog.at_level(logging.INFO, logger="lowerings.ops.registry"):
        assert configure_backends({"linear_cross_entropy": "auto"}) == {"linear_cross_entropy": "reference"}
    lines = [r.getMessage() for r in caplog.records if "linear_cross_entropy" in r.getMessage()]
    assert lines == ["kernels.linear_cross_entropy = auto -> reference "
                     "(skipped liger: python module 'liger_kernel' is not installed)"]
    configure_backends({"linear_cross_entropy": before})


def test_strided_inputs():
    hidden, weight, labels = _inputs(8)
    h_t = hidden.detach().t().contiguous().t().requires_grad_()  # column-major [T, H]
    w_t = weight.detach().t().contiguous().t().requires_grad_()
    torch.library.opcheck(torch.ops.titan_kimi.linear_cross_entropy.default, (h_t, w_t, labels, 8, True, True))
    loss = ops.linear_cross_entropy(h_t, w_t, labels, normalizer=9.0)
    ref = _full_ce(hidden, weight, labels, 9.0)
    for got, want in zip(torch.autograd.grad(loss, [h_t, w_t]), torch.autograd.grad(ref, [hidden, weight])):
        assert _rel(got, want) < 1e-5


def test_under_autocast_the_operands_are_cast_as_for_a_matmul():
    """fp32 master weights under bf16 autocast: the op sees bf16 operands (as the head's matmul would), and the
    fp32 leaves get their gradients through the casts."""
    hidden, weight, labels = _inputs(9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(hidden, weight, labels, normalizer=40.0)
    loss.backward()
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    ref = ops.linear_cross_entropy(h16, w16, labels, normalizer=40.0)
    ref.backward()
    assert _rel(loss, ref) < 1e-6
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert _rel(hidden.grad, h16.grad.float()) < 1e-6 and _rel(weight.grad, w16.grad.float()) < 1e-6
