"""A K3.1 DSA layer (indexer + sparse MLA) against dense-masked MLA, forward + backward: python scripts/bench/dsa_layer.py --T 8192 32768 [--out FILE.json]

    python scripts/bench/dsa_layer.py --T 8192 16384 32768 [--reps 5] [--out dsa.json]
    python scripts/bench/dsa_layer.py --tiny --T 256      # smoke test on CPU with a tiny layer
    python scripts/bench/dsa_layer.py --T 32768 --compile # both paths under torch.compile (the default mode)

The layer is the model's GatedMLA with the K3.1 geometry (hidden 7168, 96 heads, q-LoRA 1536, kv latent 512,
nope 128 + rope 64, v 128, indexer 64 x 128, top-k 2048), bf16. "dsa" runs it as the model does (indexer top-k,
then sparse MLA in the absorbed latent form on the selected backends); "dense_masked" computes the same
attention the plain way (all heads' K/V expanded) with an additive mask that keeps only the selected keys,
through scaled_dot_product_attention. Both get the same indices, so the outputs agree. Reported: median ms of
forward + backward (gradients of the input and every trained weight), and peak memory above the inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F

from lowerings.inductor.modes import compile_mode
from lowerings.ops import configure_backends
from titan_kimi.models.kimi_k3 import build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.mla import GatedMLA
from timing import wall_ms_and_peak, write_rows  # scripts/bench/ is sys.path[0]


def dense_masked(mla: GatedMLA, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Plain MLA (spec §4.2) restricted to ``indices [T, k]`` by a boolean mask (one sequence, B = 1)."""
    _, T, _ = x.shape
    n = mla.n_heads
    q, _ = mla._queries(x)
    q = q.view(1, T, n, mla.qk_dim)
    c_kv, k_rope = mla.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope], dim=-1)
    kv = mla.kv_b_proj(mla.kv_a_layernorm(c_kv)).view(1, T, n, mla.nope + mla.v_dim)
    k = torch.cat([kv[..., : mla.nope], k_rope.unsqueeze(2).expand(1, T, n, mla.rope)], dim=-1)
    v = kv[..., mla.nope :]
    allowed = torch.zeros(T, T + 1, dtype=torch.bool, device=x.device)
    allowed.scatter_(1, torch.where(indices >= 0, indices.long(), T), True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=allowed[:, :T].view(1, 1, T, T), scale=mla.scale)
    out = out.transpose(1, 2).reshape(1, T, n * mla.v_dim) * torch.sigmoid(mla.g_proj(x))
    return mla.o_proj(out)


def gated_mla_layer(args, device: torch.device) -> tuple[GatedMLA, torch.dtype, list[torch.nn.Parameter]]:
    """The model's GatedMLA with ``args``' geometry, seeded (bf16 on CUDA, fp32 on CPU), and its trained weights."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        mla = GatedMLA(args)
        mla.init_weights()
    mla.to(dtype)
    return mla, dtype, [p for p in mla.parameters() if p.requires_grad]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the k31_debug layer geometry (CPU smoke test)")
    parser.add_argument("--compile", action="store_true",
                        help="run both paths under torch.compile (compile mode `default`; the first call compiles)")
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not opts.tiny:
        print("dsa_layer.py needs a CUDA GPU for the K3.1 geometry (use --tiny on CPU)", file=sys.stderr)
        return 2
    configure_backends({"indexer_topk": "auto", "sparse_mla": "auto"})
    args = model_args_for("k31_debug" if opts.tiny else "k31")
    mla, dtype, params = gated_mla_layer(args, device)
    rows = []
    print("| T | path | fwd+bwd ms | peak MiB | speed-up |\n|---|---|---|---|---|")
    for T in opts.T:
        x = torch.randn(1, T, args.dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        seq = build_sequence_info(1, T, device)
        indices = mla.indexer(x, mla.q_a_layernorm(mla.q_a_proj(x)), seq)

        layer, plain, scope = mla, dense_masked, contextlib.nullcontext
        if opts.compile:  # fresh graphs per T: static shapes, as a training run at one sequence length sees
            torch._dynamo.reset()
            mode = compile_mode("default")
            layer, plain = torch.compile(mla, **mode.compile_options()), torch.compile(dense_masked, **mode.compile_options())
            scope = mode.lowering_scope

        def dsa():
            with scope():
                torch.autograd.grad(layer(x, seq), [x, *params], grad)

        def reference():
            with scope():
                torch.autograd.grad(plain(mla, x, indices), [x, *params], grad)

        with torch.no_grad():
            expected = dense_masked(mla, x, indices).float()
            check = ((mla(x, seq).float() - expected).norm() / expected.norm()).item()
            del expected
        ms_dsa, mem_dsa = wall_ms_and_peak(dsa, opts.reps, device)
        ms_ref, mem_ref = wall_ms_and_peak(reference, opts.reps, device)
        for path, ms, mem in (("dsa", ms_dsa, mem_dsa), ("dense_masked", ms_ref, mem_ref)):
            rows.append(dict(T=T, path=path, ms=ms, peak_mib=mem, rel_diff=check, compiled=opts.compile))
        print(f"| {T} | dsa | {ms_dsa:.2f} | {mem_dsa:.0f} | {ms_ref / ms_dsa:.2f}x |")
        print(f"| {T} | dense_masked | {ms_ref:.2f} | {mem_ref:.0f} | 1.00x |  (outputs differ by {check:.2e} rel)")
    if opts.out:
        write_rows(opts.out, rows, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
