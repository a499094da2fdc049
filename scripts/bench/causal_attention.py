"""kernels.causal_attention sdpa / flex / varlen, forward + backward, on one GPU: python scripts/bench/causal_attention.py [--docs 100 1000] [--out FILE.json]

Row of S = 8,192 tokens packed with documents of 100, 1,000 or 4,000 tokens, or one document (plain causal:
sdpa then runs is_causal, no mask); 16 heads (k3_small) and 96 (K3); qk head dim 192, v 128, bf16. Both
backends run through ``lowerings.ops.causal_attention`` as the model calls it (flex from eager code goes through
the op's compiled wrapper, BlockMask build included), except flex on the plain causal row: the op sends such rows
to SDPA under both backends, so that row times flex's kernel directly (the measurement behind the routing).
varlen (torch's FlashAttention varlen kernel over the documents' cu_seqlens, padded to 64 slots as the trainer
pads them) runs on the packed rows only. Per case: median fwd+bwd ms over repeats after warm-up, the BlockMask's
build alone, the fraction of 128 x 128 blocks flex computes, and flex's and varlen's relative errors against
sdpa. Prints a markdown table; ``--out`` writes the same as JSON. About two minutes on an H200 (most of it
flex's compiles: one per head count and mask kind).

    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/causal_attention.py --out causal_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.kernels.flex_attention import document_causal_block_mask, flex_causal_attention  # noqa: E402
from lowerings.ops import causal_attention, configure_backends  # noqa: E402
from titan_kimi.models.kimi_k3.sequence import build_sequence_info  # noqa: E402
from timing import median_cuda_ms, package_versions, rel_err  # noqa: E402  (scripts/bench/ is sys.path[0])

DQK, DV = 192, 128
DOCS = {"100": 100, "1000": 1000, "4000": 4000, "one": None}


def seg_start_of(seq: int, doc_len: int | None) -> torch.Tensor | None:
    if doc_len is None:
        return None
    pos = torch.arange(seq, device="cuda", dtype=torch.int32)
    return (pos - pos % doc_len).unsqueeze(0)


def bench_case(seq: int, heads: int, doc_len: int | None, warmup: int, repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, heads, DQK, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, seq, heads, DQK, device="cuda", generator=g).bfloat16().requires_grad_()
    v = torch.randn(1, seq, heads, DV, device="cuda", generator=g).bfloat16().requires_grad_()
    grad_out = torch.randn(1, seq, heads, DV, device="cuda", generator=g).bfloat16()
    seg_start = seg_start_of(seq, doc_len)
    cu_seqlens = None
    if doc_len is not None:
        doc_ids = (torch.arange(seq, device="cuda") // doc_len).unsqueeze(0)
        cu_seqlens = build_sequence_info(1, seq, torch.device("cuda"), doc_ids).cu_seqlens
    scale = DQK**-0.5
    row: dict = {"seq": seq, "heads": heads, "doc_len": doc_len or seq}
    outputs = {}
    for backend in ("sdpa", "flex", "varlen") if doc_len is not None else ("sdpa", "flex"):
        configure_backends({"causal_attention": backend})

        def step() -> torch.Tensor:
            q.grad = k.grad = v.grad = None
            if backend == "flex" and seg_start is None:
                # the op sends plain causal rows to SDPA under both backends; this times flex's own causal
                # kernel, the measurement behind that routing
                out = flex_causal_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=scale).transpose(1, 2)
            else:
                out = causal_attention(q, k, v, scale=scale, seg_start=seg_start, cu_seqlens=cu_seqlens)
            out.backward(grad_out)
            return out

        started = time.perf_counter()
        out = step()  # first call: flex compiles here, outside the timed runs
        torch.cuda.synchronize()
        row[f"{backend}_first_call_s"] = time.perf_counter() - started
        outputs[backend] = (out.detach(), q.grad, k.grad, v.grad)
        row[f"{backend}_ms"] = median_cuda_ms(step, warmup, repeats)
    row["speedup"] = row["sdpa_ms"] / row["flex_ms"]
    for backend in ("flex", "varlen"):
        if backend in outputs:
            row[f"{backend}_rel_err_vs_sdpa"] = max(rel_err(a, b) for a, b in zip(outputs[backend], outputs["sdpa"]))
    return row


def mask_stats(seq: int, doc_len: int | None, warmup: int, repeats: int) -> dict:
    seg_start = seg_start_of(seq, doc_len)
    build = torch.compile(lambda s: document_causal_block_mask(s, None, batch=1, q_len=seq, kv_len=seq,
                                                               device=torch.device("cuda")).kv_num_blocks)
    build(seg_start)
    mask = document_causal_block_mask(seg_start, None, batch=1, q_len=seq, kv_len=seq, device=torch.device("cuda"))
    n = -(-seq // 128)
    computed = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item()
    return {"mask_build_ms": median_cuda_ms(lambda: build(seg_start), warmup, repeats), "blocks_computed": computed / (n * n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 96])
    parser.add_argument("--docs", nargs="+", choices=list(DOCS), default=list(DOCS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    masks = {d: mask_stats(args.seq, DOCS[d], args.warmup, args.repeats) for d in args.docs}
    rows = []
    for heads in args.heads:
        for d in args.docs:
            try:
                row = bench_case(args.seq, heads, DOCS[d], args.warmup, args.repeats)
            except torch.OutOfMemoryError as err:
                row = {"seq": args.seq, "heads": heads, "doc_len": DOCS[d] or args.seq, "error": f"OOM: {err}"[:200]}
            rows.append({**row, **masks[d]})
            torch.cuda.empty_cache()
    configure_backends({"causal_attention": "auto"})

    print("| heads | doc len | sdpa ms | flex ms | speedup | flex blocks | mask build ms | flex err | "
          "flex first call s | varlen ms | varlen err | varlen first call s |\n|---|---|---|---|---|---|---|---|---|"
          "---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['heads']} | {r['doc_len']} | {r['error']} |")
            continue
        print(f"| {r['heads']} | {r['doc_len']:,} | {r['sdpa_ms']:.2f} | {r['flex_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['blocks_computed']:.1%} | {r['mask_build_ms']:.3f} | {r['flex_rel_err_vs_sdpa']:.1e} | "
              f"{r['flex_first_call_s']:.1f} | " + (f"{r['varlen_ms']:.2f} | {r['varlen_rel_err_vs_sdpa']:.1e} | "
                                                      f"{r['varlen_first_call_s']:.1f} |" if "varlen_ms" in r
                                                      else "— | — | — |"))
    if args.out:
        versions = package_versions(("torch", "triton"))
        meta = {"device": torch.cuda.get_device_name(), "versions": versions, "qk_dim": DQK, "v_dim": DV,
                "dtype": "bfloat16", "warmup": args.warmup, "repeats": args.repeats}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
