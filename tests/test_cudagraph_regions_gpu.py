"""GPU: ``compile.mode = reduce-overhead`` (CUDA graphs over the compiled regions) with full activation
checkpointing, whose backward replays a block's forward graphs, and with the MoE blocks compiled by sub-module
as under expert parallelism (the routed experts eager between the graphs). Two cases each: one microbatch per
step over two steps, and two microbatches in flight (both forwards before either backward, as a pipeline's
schedule or gradient accumulation over held outputs runs them). Gradients against the same model compiled
under ``default`` (no CUDA graphs)."""

import pytest
import torch

from lowerings.ops.registry import configure_backends
from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.parallel.compile import apply_compile

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.fixture
def gpu_kernels():
    configure_backends({"kda": "fla", "indexer_topk": "triton", "sparse_mla": "triton"})
    yield
    configure_backends({"kda": "reference", "indexer_topk": "reference", "sparse_mla": "reference"})


def grads(mode: str, experts_outside: bool, in_flight: int) -> dict[str, torch.Tensor]:
    args = model_args_for("k31_debug")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(args)
    model.init_weights()
    model.to(torch.bfloat16)
    apply_activation_checkpointing(model, "full", "op")
    apply_compile(model, mode, fullgraph=True, experts_outside=experts_outside, granularity="block")
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, S = 1, 256
    batches = []
    for _ in range(2):
        tokens = torch.randint(1, args.vocab_size, (B, S), device="cuda", generator=gen)
        doc = torch.ones(B, S, dtype=torch.int32, device="cuda")
        doc[0, 100:] += 1
        cot = torch.randn(B, S, args.dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        batches.append((tokens, doc, cot))
    for step in range(2):  # the second step replays the graphs the first one recorded
        model.zero_grad(set_to_none=True)
        held = []
        for i, (tokens, doc, cot) in enumerate(batches):
            held.append((model(tokens, doc_ids=doc, return_hidden=True), cot))
            if len(held) == in_flight or i == len(batches) - 1:
                for hidden, c in held:
                    (hidden.float() * c.float()).sum().backward()
                held = []
    return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad.float()
            for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("experts_outside", [False, True])
def test_reduce_overhead_with_full_checkpointing_matches_default(gpu_kernels, experts_outside, in_flight):
    ref = grads("default", experts_outside, in_flight)
    got = grads("reduce-overhead", experts_outside, in_flight)
    assert ref.keys() == got.keys() and len(ref) > 0
    worst = max((rel_err(got[n], g), n) for n, g in ref.items())
    assert worst[0] < 2e-2, worst
