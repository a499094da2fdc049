"""Times the indexer-distillation kernels beside the layer's own sparse MLA at one DSA layer's shape. `python scripts/bench/indexer_kl.py --out DIR [--tokens 8192] [--heads 16]`

At k31_small's shape (16 heads x 576, a 64 x 128 indexer, top-2,048) over one row of --tokens tokens: the sparse
stage's ops (target mass, scores at the selected keys, their backward, the latter also at each tile config of
SCORES_BACKWARD_CONFIGS), the warm-up's (attention LSE, dense KL, its backward), and the sparse-MLA forward and
backward they sit beside (the backward's kernels with and without the head-summed target), each the median
CUDA-event time of 20 calls. Writes DIR/indexer_kl_bench.json and prints a table (~1 minute on an H200, kernel JIT included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

from timing import median_cuda_ms, package_versions  # noqa: E402  (scripts/bench/ is sys.path[0])
from lowerings.kernels import indexer_kl, sparse_mla_bwd  # noqa: E402
from lowerings.ops import configure_backends, sparse_mla  # noqa: E402
from lowerings.ops.indexer_topk import indexer_topk  # noqa: E402


# tiles of the scores backward tried beside its default (keys per step, warps, pipeline stages)
SCORES_BACKWARD_CONFIGS = [dict(BLOCK_N=n, BLOCK_H=64, num_warps=w, num_stages=st)
                           for n, w, st in ((64, 8, 2), (32, 4, 2), (32, 4, 3), (128, 8, 2), (64, 8, 3), (32, 8, 2))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2048)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    configure_backends({"sparse_mla": "auto", "indexer_topk": "auto"})
    T, H, D, HI, DI = opts.tokens, opts.heads, 576, 64, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    q, kv = r(T, H, D).bfloat16(), r(T, D).bfloat16()
    iq, ik, iw = r(T, HI, DI).bfloat16(), r(T, DI).bfloat16(), r(T, HI).abs() * HI**-0.5
    seg = torch.zeros(T, dtype=torch.int32, device="cuda")
    scale, iscale = 192**-0.5, DI**-0.5
    idx = indexer_topk(iq, ik, iw, seg, topk=opts.topk, scale=iscale)
    _, lse = sparse_mla(q, kv, idx, scale=scale, d_v=512)
    lse_all = indexer_kl.attention_lse(q, kv, seg, scale)
    _, stats = indexer_kl.dense_kl(iq, ik, iw, q, kv, lse_all, seg, 0, iscale, scale)
    scores = indexer_kl.scores_at(iq, ik, iw, idx, iscale)
    d_scores = torch.randn_like(scores).masked_fill(idx < 0, 0.0)
    grad = torch.ones(T, device="cuda")
    q_req, kv_req = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, _ = sparse_mla(q_req, kv_req, idx, scale=scale, d_v=512)
    d_out = torch.randn_like(out)
    out_k = out.detach()
    cases = {
        "sparse: target mass": lambda: indexer_kl.sparse_target(q, kv, lse, idx, scale),
        "sparse: scores at selected": lambda: indexer_kl.scores_at(iq, ik, iw, idx, iscale),
        "sparse: scores backward": lambda: indexer_kl.scores_at_backward(d_scores, iq, ik, iw, idx, iscale),
        "warm-up: attention LSE": lambda: indexer_kl.attention_lse(q, kv, seg, scale),
        "warm-up: dense KL": lambda: indexer_kl.dense_kl(iq, ik, iw, q, kv, lse_all, seg, 0, iscale, scale),
        "warm-up: dense KL backward": lambda: indexer_kl.dense_kl_backward(grad, iq, ik, iw, q, kv, lse_all, seg,
                                                                          stats, 0, iscale, scale),
        "layer: sparse MLA forward": lambda: sparse_mla(q, kv, idx, scale=scale, d_v=512),
        "layer: sparse MLA backward": lambda: torch.autograd.grad(out, (q_req, kv_req), d_out, retain_graph=True),
        "layer: sparse MLA backward kernels": lambda: sparse_mla_bwd.sparse_mla_backward(
            d_out, q, kv, idx, out_k, lse, scale, 512),
        "sparse: sparse MLA backward kernels + target": lambda: sparse_mla_bwd.sparse_mla_backward(
            d_out, q, kv, idx, out_k, lse, scale, 512, head_mass=True),
        "layer: indexer top-k": lambda: indexer_topk(iq, ik, iw, seg, topk=opts.topk, scale=iscale),
    }
    for c in SCORES_BACKWARD_CONFIGS:
        name = f"sparse: scores backward N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
        cases[name] = lambda c=c: indexer_kl.scores_at_backward(d_scores, iq, ik, iw, idx, iscale, config=c)
    times = {name: median_cuda_ms(fn, warmup=3, repeats=20) for name, fn in cases.items()}
    result = {"tokens": T, "heads": H, "topk": opts.topk, "device": torch.cuda.get_device_name(), "ms": times,
              "versions": package_versions(("torch", "triton")), "command": " ".join(sys.argv)}
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "indexer_kl_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, ms in times.items():
        print(f"{name:<32} {ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
