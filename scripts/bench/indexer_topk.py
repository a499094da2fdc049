"""indexer_topk's triton and cudnn (cuDNN's sm90 DSA indexer) backends at K3.1's shape: python scripts/bench/indexer_topk.py [--out FILE.json]

K3.1's indexer: 64 query heads x 128 against one key head, top-2,048 keys per query, scores
``sum_h w[t,h] relu(scale q[t,h].k[s])`` inside each document's causal window (lowerings/ops/indexer_topk.py).
cuDNN-FE 1.32.0's fused score + top-k (``indexer_forward_top_k_wrapper``) is SM100-only; on sm90 its path is
``indexer_forward_wrapper`` (THD over the documents' ``cu_seqlens``, ``ratio = 1``: uncompressed keys), which
writes a dense fp32 ``[T, max_doc_len]`` score row per query (``sm_scale * sum_h w_h relu(q_h . k)``, -inf
outside the causal window), then ``indexer_top_k_wrapper`` (radix top-k per row, each row limited to its causal
length) and ``local_to_global_wrapper`` (document-local ids to row ids). Both need the CuTe-DSL runtime
(``nvidia-cutlass-dsl[cu13]``).

Per layout: median ms of each pipeline (CUDA events), cuDNN's first call (its CuTe-DSL compile, which a first
training step would pay), and how good each selection is against the fp32 reference scores: the fraction of
rows whose selected set equals the reference's, and the minimum over rows of (sum of reference scores over the
keys selected) / (the same over the reference's own top-k), 1.0 being a perfect selection (ReLU ties at 0 make
equal sets too strict a test). Two cuDNN rows: the backend (`kernels.indexer_topk = cudnn`,
lowerings/kernels/cudnn_indexer_topk.py: the dense layout with a document mask, because the op has no host-side
document lengths) and the THD pipeline above (what the backend would gain from them).

    PYTHONPATH=$PWD:/tmp/site python3 scripts/bench/indexer_topk.py --out indexer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.ops.indexer_topk import indexer_scores_reference  # noqa: E402
from timing import median_cuda_ms, package_versions  # noqa: E402  (scripts/bench/ is sys.path[0])

HEADS, DIM, TOPK = 64, 128, 2048
LAYOUTS = {"one_doc": None, "docs_1000": 1000, "docs_4000": 4000}


def documents(T: int, doc_len: int | None) -> list[int]:
    """Document boundaries [0, ..., T]."""
    if doc_len is None:
        return [0, T]
    return list(range(0, T, doc_len)) + [T]


def seg_start_of(bounds: list[int], T: int) -> torch.Tensor:
    seg = torch.empty(T, dtype=torch.int32)
    for a, b in zip(bounds, bounds[1:]):
        seg[a:b] = a
    return seg.cuda()


def _as_sets(idx: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of key ids as sorted rows padded with int max, comparable across widths."""
    big = torch.iinfo(torch.int64).max
    out = torch.where(valid, idx.long(), torch.full_like(idx, big, dtype=torch.long)).sort(-1).values
    pad = torch.full((out.shape[0], width - out.shape[1]), big, dtype=torch.long, device=out.device)
    return torch.cat([out, pad], -1)


def reference_quality(selected: torch.Tensor, q, k, w, seg, scale: float, chunk: int = 512) -> dict:
    """Rows whose set equals the fp32 reference's top-k, and min over rows of the score mass kept."""
    T = q.shape[0]
    equal, worst = 0, 1.0
    for r0 in range(0, T, chunk):
        rows = slice(r0, min(T, r0 + chunk))
        scores = indexer_scores_reference(q, k, w, seg, rows, scale)  # [rows, T], -inf outside the window
        ref_vals, ref_idx = scores.topk(min(TOPK, T), dim=-1)
        valid_ref = torch.isfinite(ref_vals)
        ref_mass = torch.where(valid_ref, ref_vals, torch.zeros_like(ref_vals)).sum(-1)
        sel = selected[rows].long()
        ok = sel >= 0
        got = torch.where(ok, scores.gather(1, sel.clamp_min(0)), torch.zeros(sel.shape, device=sel.device))
        mass = got.sum(-1)  # -inf when a key outside the window was selected
        ratio = torch.where(ref_mass > 0, mass / ref_mass.clamp_min(1e-30), torch.ones_like(mass))
        worst = min(worst, float(ratio.min()))
        width = max(sel.shape[1], ref_idx.shape[1])
        equal += int((_as_sets(sel, ok, width) == _as_sets(ref_idx, valid_ref, width)).all(-1).sum())
    return {"rows_equal_to_reference": equal / T, "min_score_mass_kept": worst}


def cudnn_pipeline(q, k, w, bounds: list[int], scale: float, slots: int | None = None, max_len: int | None = None):
    """Returns a callable giving [T, TOPK] global key ids (-1 = empty) through cuDNN's sm90 pieces. ``slots``:
    cu_seqlens padded with zero-length documents to that many (as the model pads them); ``max_len``: the
    max_seqlen given to the kernels (default the longest document; a bucket or T is what a backend without host
    document lengths could pass)."""
    from cudnn.deepseek_sparse_attention import (indexer_forward_wrapper, indexer_top_k_wrapper,
                                                 local_to_global_wrapper)

    T = q.shape[0]
    padded = bounds + [bounds[-1]] * ((slots or 0) + 1 - len(bounds))
    cu = torch.tensor(padded, dtype=torch.int32, device="cuda")
    max_len = max_len or max(b - a for a, b in zip(bounds, bounds[1:]))
    local_pos = torch.cat([torch.arange(b - a, dtype=torch.int32) for a, b in zip(bounds, bounds[1:])]).cuda()
    row_lens = (local_pos + 1).contiguous()  # each query's causal window inside its document
    k3 = k.view(T, 1, DIM)

    def run() -> torch.Tensor:
        scores = indexer_forward_wrapper(q, k3, w, ratio=1, sm_scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         max_seqlen_q=max_len, max_seqlen_k=max_len)["scores"]
        local = indexer_top_k_wrapper(scores, row_lens, top_k=min(TOPK, max_len), next_n=1,
                                      return_val=False)["indices"]
        return local_to_global_wrapper(local, max_len, cu_seqlens_q=cu, cu_seqlens_k=cu)["indices"]

    return run


def time_selection(row: dict, name: str, build, warmup: int, repeats: int, quality) -> None:
    """Into ``row``: the first call (s, its compile) of the selection ``build()`` returns, its median ms and
    ``quality`` of what it selects; ``<name>_error`` when it fails (a missing runtime or a refused shape), the
    other rows kept."""
    try:
        select = build()
        t0 = time.perf_counter()
        selected = select()
        torch.cuda.synchronize()
        row[f"{name}_first_call_s"] = time.perf_counter() - t0
        row[f"{name}_ms"] = median_cuda_ms(select, warmup, repeats)
        row[name] = quality(selected)
    except Exception as err:
        row[f"{name}_error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()


def bench_layout(T: int, name: str, doc_len: int | None, warmup: int, repeats: int) -> dict:
    from lowerings.kernels.cudnn_indexer_topk import cudnn_indexer_topk
    from lowerings.kernels.indexer_topk import indexer_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(T, HEADS, device="cuda", generator=gen) * (HEADS * DIM) ** -0.5  # fp32, as the model's
    bounds = documents(T, doc_len)
    seg = seg_start_of(bounds, T)
    scale = DIM**-0.5
    row: dict = {"layout": name, "tokens": T, "documents": len(bounds) - 1}

    ours = lambda: indexer_topk(q, k, w, seg, TOPK, scale)  # noqa: E731
    selected = ours()  # autotunes
    row["triton_ms"] = median_cuda_ms(ours, warmup, repeats)
    quality = lambda selected: reference_quality(selected, q, k, w, seg, scale)  # noqa: E731
    row["triton"] = quality(selected)
    # the backend (dense layout + document mask: no host integer needed), then cuDNN's THD layout over the
    # documents (needs the longest document on the host)
    backend = lambda: cudnn_indexer_topk(q, k, w, seg, TOPK, scale)  # noqa: E731
    time_selection(row, "backend", lambda: backend, warmup, repeats, quality)
    # the backend as the model calls it: its padded cu_seqlens and the row length (the THD layout)
    slots = max(64, 1 << (len(bounds) - 2).bit_length())
    padded = torch.tensor(bounds + [bounds[-1]] * (slots + 1 - len(bounds)), dtype=torch.int32, device="cuda")
    backend_thd = lambda: cudnn_indexer_topk(q, k, w, seg, TOPK, scale, cu_seqlens=padded, max_seqlen=T)  # noqa: E731
    time_selection(row, "backend_thd", lambda: backend_thd, warmup, repeats, quality)
    time_selection(row, "cudnn", lambda: cudnn_pipeline(q, k, w, bounds, scale), warmup, repeats, quality)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    bucket = min(T, 1 << (longest - 1).bit_length())
    for variant, max_len in (("thd_slots_bucket", bucket), ("thd_slots_T", T)):  # the model's padded cu_seqlens
        time_selection(row, variant, lambda: cudnn_pipeline(q, k, w, bounds, scale, slots=slots, max_len=max_len),
                       warmup, repeats, quality)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = [bench_layout(args.tokens, name, LAYOUTS[name], args.warmup, args.repeats) for name in args.layouts]
    print("| layout | documents | triton ms | cudnn backend: dense / THD (as the model calls it) ms | cudnn THD "
          "pipeline ms | first call s: backend / THD | equal sets: triton / backend / backend THD / THD | min score "
          "mass kept: triton / backend / backend THD / THD |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        def cell(key: str, fmt: str = ".2f") -> str:
            name = key.removesuffix("_ms").removesuffix("_first_call_s")  # the selection the cell belongs to
            return format(r[key], fmt) if key in r else r.get(name + "_error", "—")[:80]

        def quality(metric: str, fmt: str) -> str:
            return " / ".join(format(r[n][metric], fmt) if n in r else "—"
                              for n in ("triton", "backend", "backend_thd", "cudnn"))

        print(f"| {r['layout']} | {r['documents']} | {r['triton_ms']:.2f} | {cell('backend_ms')} / "
              f"{cell('backend_thd_ms')} | "
              f"{cell('cudnn_ms')} | {cell('backend_first_call_s', '.1f')} / {cell('cudnn_first_call_s', '.1f')} | "
              f"{quality('rows_equal_to_reference', '.3f')} | {quality('min_score_mass_kept', '.4f')} |")
    print("\ncuDNN's THD layout over cu_seqlens padded to the model's slots (>= 64), max_seqlen a power-of-two "
          "bucket of the longest document or T:\n\n| layout | bucket ms | T ms | equal sets: bucket / T |\n|---|---|---|---|")
    for r in rows:
        eq = " / ".join(format(r[v]["rows_equal_to_reference"], ".3f") if v in r else "—"
                        for v in ("thd_slots_bucket", "thd_slots_T"))
        print(f"| {r['layout']} | {r.get('thd_slots_bucket_ms', float('nan')):.2f} | "
              f"{r.get('thd_slots_T_ms', float('nan')):.2f} | {eq} |")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "heads": HEADS, "dim": DIM, "topk": TOPK,
                "versions": package_versions(("torch", "triton", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"))}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
