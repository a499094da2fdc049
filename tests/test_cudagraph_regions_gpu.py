"""GPU: ``compile.mode = reduce-overhead`` (CUDA graphs over the compiled regions) with the MoE blocks compiled by
sub-module as under expert parallelism (the routed experts eager between the graphs; whole blocks under
reduce-overhead are what the small recipes run), over two steps (the second replays what the first recorded),
against the same model compiled under ``default``. Four layers of k31_debug (KDA and MLA blocks, dense and MoE
FFNs) keep the compiles short. Activation checkpointing and pipeline parallelism are refused under this mode
(``titan_kimi.config.rules.cuda_graphs_where_they_hold``)."""

import dataclasses

import pytest
import torch

from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.parallel.compile import apply_compile

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def grads(mode: str, experts_outside: bool) -> dict[str, torch.Tensor]:
    args = dataclasses.replace(model_args_for("k31_debug"), n_layers=4, kda_layers=(1, 2, 3), full_attn_layers=(4,))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(args)
    model.init_weights()
    model.to(torch.bfloat16)
    apply_compile(model, mode, fullgraph=True, experts_outside=experts_outside, granularity="block")
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(1, args.vocab_size, (1, 256), device="cuda", generator=gen)
    doc = torch.ones(1, 256, dtype=torch.int32, device="cuda")
    doc[0, 100:] += 1
    cot = torch.randn(1, 256, args.dim, device="cuda", generator=gen)
    for _ in range(2):  # the second step replays the graphs the first one recorded
        model.zero_grad(set_to_none=True)
        hidden = model(tokens, doc_ids=doc, return_hidden=True)
        (hidden.float() * cot).sum().backward()
    return {n.replace("_orig_mod.", ""): p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def test_reduce_overhead_over_sub_module_regions_matches_default(gpu_kernels):
    ref = grads("default", experts_outside=True)
    got = grads("reduce-overhead", experts_outside=True)
    assert ref.keys() == got.keys() and len(ref) > 0
    worst = max((rel_err(got[n], g), n) for n, g in ref.items())
    assert worst[0] < 2e-2, worst
