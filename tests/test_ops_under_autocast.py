"""The custom ops under ``torch.autocast``: an op computes in the precision it was written for, so a call inside
``torch.autocast("cpu", dtype=torch.bfloat16)`` (the trainer's single-device mixed precision) gives the outputs
and gradients of the same call without it, in the same dtypes. Autocast does not cast a custom op's inputs, but
its body runs with autocast's state still on: the fp32 matmuls of a reference body would run in bf16.

Reference (plain torch) backends on CPU, fresh seeded random inputs. Forward and backward both run inside the
autocast region (a gradient taken there), so the bodies of the backward ops see autocast too."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from lowerings import ops
from lowerings.ops.indexer_kl import (attention_lse_op, dense_kl_op, scores_at_op, sparse_mla_distilled_op,
                                     sparse_target_op)
from lowerings.ops.linear_cross_entropy import linear_cross_entropy_op
from lowerings.ops.registry import ResolvedBackends, install_backends, resolved_backends
from lowerings.ops.router_logits import router_logits_op

Outputs = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def reference_backends():
    """Every op on its reference backend (another test of this worker may have chosen others)."""
    saved = resolved_backends()
    install_backends(ResolvedBackends())
    try:
        yield
    finally:
        install_backends(saved)


def randn(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def with_grads(outputs: Outputs, leaves: dict[str, torch.Tensor], gen: torch.Generator) -> Outputs:
    """``outputs`` (detached) and the gradients of ``sum(out * cotangent)`` over its floating-point outputs that
    carry a graph, in each of ``leaves``."""
    diff = [o for o in outputs.values() if o.requires_grad]
    cots = [randn(gen, *o.shape).to(o.dtype) for o in diff]
    grads = torch.autograd.grad(diff, list(leaves.values()), cots, allow_unused=True)
    result = {name: o.detach() for name, o in outputs.items()}
    result.update({f"d_{name}": g for name, g in zip(leaves, grads) if g is not None})
    return result


def leaves_of(gen: torch.Generator, shapes: dict[str, tuple[int, ...]], dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: randn(gen, *shape).to(dtype).requires_grad_() for name, shape in shapes.items()}


# ------------------------------------------------------------------------------------------------- the calls
def kda_call(packed: bool, lower_bound: float | None) -> Callable[[], Outputs]:
    """``packed``: two documents in one row (cu_seqlens); else two rows with an initial and a final state.
    lower_bound -5 takes the reference's factored scores (matmuls), None its [C, C, K] decay (einsums)."""
    def call() -> Outputs:
        gen = torch.Generator().manual_seed(1)
        B, T, H, K, V = (1, 21, 2, 8, 8) if packed else (2, 13, 2, 8, 8)
        x = leaves_of(gen, dict(q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), g=(B, T, H, K)))
        x["beta"] = torch.rand(B, T, H, generator=gen).requires_grad_()
        x["A_log"] = torch.empty(H).uniform_(1, 16, generator=gen).log().requires_grad_()
        x["dt_bias"] = (randn(gen, H * K) * 0.3).requires_grad_()
        kw = dict(scale=K ** -0.5, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound)
        if packed:
            kw["cu_seqlens"] = torch.tensor([0, 9, T], dtype=torch.int32)
        else:
            x["initial_state"] = randn(gen, B, H, K, V).requires_grad_()
            kw.update(initial_state=x["initial_state"], output_final_state=True)
        o, final = ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        return with_grads({"o": o} if final is None else {"o": o, "final": final}, x, gen)
    return call


def indexer_inputs(gen: torch.Generator, T: int = 20, H: int = 3, D: int = 24, HI: int = 4, DI: int = 16
                   ) -> dict[str, torch.Tensor]:
    """The main attention's q [T,H,D], kv [T,D] and the indexer's iq [T,HI,DI], ik [T,DI], iw [T,HI], with two
    packed documents (seg_start)."""
    return dict(q=randn(gen, T, H, D, std=2.0), kv=randn(gen, T, D), iq=randn(gen, T, HI, DI), ik=randn(gen, T, DI),
                iw=randn(gen, T, HI).abs() * HI ** -0.5,
                seg=torch.tensor([0] * 8 + [8] * (T - 8), dtype=torch.int32))


def selection(gen: torch.Generator, T: int, S: int, k: int) -> torch.Tensor:
    """int32 ``[T, k]``: distinct random keys among ``S`` per query, the last slot of every third row empty."""
    idx = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    idx[::3, -1] = -1
    return idx


def sparse_mla_call(backend: str) -> Callable[[], Outputs]:
    def call() -> Outputs:
        install_backends(ResolvedBackends({"sparse_mla": backend}))
        gen = torch.Generator().manual_seed(2)
        x = leaves_of(gen, dict(q=(12, 3, 24), kv=(16, 24)))
        out, lse = ops.sparse_mla(x["q"], x["kv"], selection(gen, 12, 16, 5), scale=24 ** -0.5, d_v=16)
        return with_grads({"out": out, "lse": lse}, x, gen)
    return call


def indexer_topk_call() -> Outputs:
    """Only indices come out: enough keys that scores rounded to bf16 would pick other ones in a few rows."""
    gen = torch.Generator().manual_seed(3)
    t = indexer_inputs(gen, T=128, HI=4, DI=64)
    idx = ops.indexer_topk(t["iq"], t["ik"], t["iw"], t["seg"], topk=16, scale=64 ** -0.5)
    return {"idx": idx}


def attention_lse_call() -> Outputs:
    t = indexer_inputs(torch.Generator().manual_seed(4))
    return {"lse": attention_lse_op(t["q"], t["kv"], t["seg"], 24 ** -0.5, 0)}


def sparse_target_call() -> Outputs:
    gen = torch.Generator().manual_seed(5)
    t = indexer_inputs(gen)
    lse = randn(gen, 20, 3).abs() + 4.0
    return {"target": sparse_target_op(t["q"], t["kv"], lse, selection(gen, 20, 20, 6), 24 ** -0.5)}


def scores_at_call() -> Outputs:
    gen = torch.Generator().manual_seed(6)
    t = indexer_inputs(gen)
    x = {name: t[name].requires_grad_() for name in ("iq", "ik", "iw")}
    idx = selection(gen, 20, 20, 6)
    return with_grads({"scores": scores_at_op(x["iq"], x["ik"], x["iw"], idx, 16 ** -0.5)}, x, gen)


def dense_kl_call() -> Outputs:
    gen = torch.Generator().manual_seed(7)
    t = indexer_inputs(gen)
    x = {name: t[name].requires_grad_() for name in ("iq", "ik", "iw")}
    lse = attention_lse_op(t["q"], t["kv"], t["seg"], 24 ** -0.5, 0)
    kl, stats = dense_kl_op(x["iq"], x["ik"], x["iw"], t["q"], t["kv"], lse, t["seg"], 0, 16 ** -0.5, 24 ** -0.5)
    return with_grads({"kl": kl, "stats": stats}, x, gen)


def sparse_mla_distilled_call() -> Outputs:
    gen = torch.Generator().manual_seed(8)
    x = leaves_of(gen, dict(q=(12, 3, 24), kv=(16, 24), scores=(12, 5)))
    idx = selection(gen, 12, 16, 5)
    out, lse = sparse_mla_distilled_op(x["q"], x["kv"], idx, x["scores"], torch.rand(12, generator=gen),
                                       24 ** -0.5, 16)
    return with_grads({"out": out, "lse": lse}, x, gen)


def attn_res_mix_call(dtype: torch.dtype) -> Callable[[], Outputs]:
    def call() -> Outputs:
        gen = torch.Generator().manual_seed(9)
        x = leaves_of(gen, dict(bank=(6, 3, 32), partial=(6, 32), norm_weight=(32,), proj_weight=(32,)), dtype)
        out = ops.attn_res_mix(x["bank"], x["partial"], x["norm_weight"], x["proj_weight"], 1e-5)
        return with_grads({"out": out}, x, gen)
    return call


def router_logits_call() -> Outputs:
    """The op itself (its wrapper casts the operands to autocast's dtype on purpose): bf16 operands."""
    gen = torch.Generator().manual_seed(10)
    x = leaves_of(gen, dict(x=(9, 300), weight=(6, 300)), torch.bfloat16)
    return with_grads({"logits": router_logits_op(x["x"], x["weight"])}, x, gen)


def linear_cross_entropy_call() -> Outputs:
    """The op itself (its wrapper casts the operands to autocast's dtype on purpose): fp32 operands."""
    gen = torch.Generator().manual_seed(11)
    hidden, weight = randn(gen, 10, 16), randn(gen, 40, 16) * 0.25
    labels = torch.randint(0, 40, (10,), generator=gen)
    labels[3] = -100
    loss, d_hidden, d_weight = linear_cross_entropy_op(hidden, weight, labels, 4, True, True)
    return {"loss": loss, "d_hidden": d_hidden, "d_weight": d_weight}


CALLS: dict[str, Callable[[], Outputs]] = {
    "kda": kda_call(packed=False, lower_bound=-5.0),
    "kda_packed_softplus_gate": kda_call(packed=True, lower_bound=None),
    "sparse_mla_reference": sparse_mla_call("reference"),
    "sparse_mla_dense": sparse_mla_call("dense"),
    "indexer_topk": indexer_topk_call,
    "attention_lse": attention_lse_call,
    "indexer_sparse_target": sparse_target_call,
    "indexer_scores_at": scores_at_call,
    "indexer_dense_kl": dense_kl_call,
    "sparse_mla_distilled": sparse_mla_distilled_call,
    "attn_res_mix_fp32": attn_res_mix_call(torch.float32),
    "attn_res_mix_bf16": attn_res_mix_call(torch.bfloat16),
    "router_logits": router_logits_call,
    "linear_cross_entropy": linear_cross_entropy_call,
}


def assert_same(got: Outputs, want: Outputs) -> None:
    """Same names and dtypes; floating-point values within fp32 rounding, integer ones equal."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {w.numel()} entries differ"


def outputs(call: Callable[[], Outputs], autocast: bool) -> Outputs:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return call()


@pytest.mark.parametrize("name", list(CALLS))
def test_op_under_autocast_computes_as_without_it(name):
    call = CALLS[name]
    assert_same(outputs(call, autocast=True), outputs(call, autocast=False))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_kda_context_parallel_reference_under_autocast_computes_as_without_it(one_rank_group, layout):
    """The context-parallel KDA's reference (plain autograd, not a custom op, the same fp32 recurrence as
    ``kda``'s) on one rank; under zigzag a document crosses the rank's two pieces."""
    def call() -> Outputs:
        gen = torch.Generator().manual_seed(12)
        B, L, H, K, V = 1, 16, 2, 8, 8
        x = leaves_of(gen, dict(q=(B, L, H, K), k=(B, L, H, K), v=(B, L, H, V), g=(B, L, H, K)))
        x["beta"] = torch.rand(B, L, H, generator=gen).requires_grad_()
        x["A_log"] = torch.empty(H).uniform_(1, 16, generator=gen).log().requires_grad_()
        seg_start = torch.tensor([[0] * 5 + [5] * 11])  # a document crossing zigzag's pieces (8 tokens each)
        o = ops.kda_context_parallel(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K ** -0.5, seg_start=seg_start,
                                     cu_seqlens=torch.tensor([0, 5, L], dtype=torch.int32), group=one_rank_group,
                                     layout=layout, A_log=x["A_log"], lower_bound=-5.0)
        # its backward is plain autograd's, which autocast governs when it runs inside: run it as the trainer
        # does, after the autocast region
        with torch.autocast("cpu", enabled=False):
            return with_grads({"o": o}, x, gen)

    assert_same(outputs(call, autocast=True), outputs(call, autocast=False))
