"""GPU: the context-parallel paths on one H200, through a single-rank NCCL group.

A single rank exercises the code paths: under the zigzag layout it holds chunks 0 and 1 of every row as two
pieces, so FLA's ``cp_context`` chain carries the state from the first piece into the second (under the
contiguous layout a single rank has nothing to receive). Results are compared with the one-rank ops on the
whole rows. Shapes are few and fixed (FLA autotunes each new one).
"""

import pytest
import torch
import torch.distributed as dist

from lowerings.ops import indexer_topk, kda
from lowerings.ops.kda_cp import kda_context_parallel, kda_context_parallel_reference
from lowerings.ops.registry import configure_backends
from titan_kimi.models.kimi_k3 import KimiK3Model, build_sequence_info, model_args_for
from titan_kimi.parallel.context_parallel import ContextParallel

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("nccl") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def backends():
    yield configure_backends
    configure_backends({"kda": "reference", "indexer_topk": "reference", "sparse_mla": "reference"})


def _kda_inputs(B=2, T=1024, H=4, K=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)
    doc = torch.ones(B, T, dtype=torch.int32, device="cuda")
    for cut in (100, T // 2 - 37, T // 2, T // 2 + 1, T - 64):  # one crosses the pieces' boundary, one starts on it
        doc[0, cut:] += 1
    doc[1, T // 3:] += 1
    inputs = [mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K),
              torch.rand(B, T, H, device="cuda", generator=gen),
              torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log(),
              torch.randn(H * K, device="cuda", generator=gen) * 0.1]
    return inputs, doc, mk(B, T, H, K)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_fla_cp_context_kda_matches_the_one_rank_result(group, backends, layout):
    """titan_kimi::kda_cp (FLA's cp_context) against titan_kimi::kda (FLA, one rank, packed rows), forward and
    backward, and against the reference state passing on the same GPU."""
    inputs, doc, cot = _kda_inputs()
    B, T, H, K = inputs[0].shape
    seq = build_sequence_info(B, T, torch.device("cuda"), doc, pad_segments=False)  # as CP builds it
    kw = dict(scale=K ** -0.5, lower_bound=-5.0)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(leaves)
        o.backward(cot)
        return o.detach(), [x.grad for x in leaves]

    backends({"kda": "fla"})
    one, g_one = run(lambda x: kda(*(t.reshape(1, B * T, *t.shape[2:]) for t in x[:5]), A_log=x[5], dt_bias=x[6],
                                   cu_seqlens=seq.cu_seqlens, **kw)[0].view(B, T, H, K))
    cp, g_cp = run(lambda x: kda_context_parallel(*x[:5], A_log=x[5], dt_bias=x[6], seg_start=seq.seg_start,
                                                  cu_seqlens=seq.cu_seqlens, group=group, layout=layout, **kw))
    ref, g_ref = run(lambda x: kda_context_parallel_reference(*x[:5], A_log=x[5], dt_bias=x[6], l2norm_qk=True,
                                                              seg_start=seq.seg_start, group=group, layout=layout,
                                                              **kw))
    assert rel_err(cp, one) < 1e-2 and rel_err(ref, one) < 1e-2
    for name, a, b, c in zip(["q", "k", "v", "g", "beta", "A_log", "dt_bias"], g_cp, g_one, g_ref):
        assert rel_err(a, b) < 2e-2 and rel_err(c, b) < 2e-2, name


def test_triton_indexer_query_runs_match_the_whole_sequence(backends):
    """The Triton indexer with queries at an offset into the keys (a CP rank's runs) against the whole rows."""
    backends({"indexer_topk": "triton"})
    gen = torch.Generator(device="cuda").manual_seed(2)
    T, HI, D, topk = 4096, 16, 64, 256
    q = torch.randn(T, HI, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(T, HI, device="cuda", generator=gen) * HI ** -0.5
    seg = torch.zeros(T, dtype=torch.int32, device="cuda")
    seg[1500:] = 1500
    whole = indexer_topk(q, k, w, seg, topk=topk, scale=D ** -0.5)
    for a, b in ((0, 1024), (1024, 2048), (3072, 4096)):
        part = indexer_topk(q[a:b], k, w[a:b], seg[a:b], topk=topk, scale=D ** -0.5, q_offset=a)
        assert torch.equal(part, whole[a:b]), (a, b)


@pytest.mark.parametrize("flavor", ["k31_debug", "k3_debug"])
def test_model_on_one_rank_zigzag_matches_without_cp(group, backends, flavor):
    """The whole model through the context-parallel paths with the GPU kernels (fla, triton), fp32."""
    backends({"kda": "fla", "indexer_topk": "triton", "sparse_mla": "triton"})
    args = model_args_for(flavor)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(args)
    model.init_weights()
    B, S = 2, 256
    tokens = torch.randint(1, args.vocab_size, (B, S), device="cuda")
    doc = torch.ones(B, S, dtype=torch.int32, device="cuda")
    for cut in (30, 127, 128, 200):
        doc[0, cut:] += 1
    cot = torch.randn(B, S, args.dim, device="cuda")

    def run(context_parallel=None):
        model.zero_grad()
        hidden = model(tokens, doc_ids=doc, return_hidden=True, context_parallel=context_parallel)
        (hidden * cot).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run()
    out, grads = run(ContextParallel(group, "zigzag"))
    assert rel_err(out, ref) < 1e-3
    worst = max(rel_err(grads[n], g) for n, g in ref_grads.items())
    assert worst < 1e-2, worst
