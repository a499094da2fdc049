"""cuDNN KDA's raw gradients against the fp32 reference's autograd (CUDA): python scripts/check/cudnn_kda_gradients.py [--tokens 1024]

The cudnn backend of ``titan_kimi::kda`` is refused because the gate input's gradient is 2.7-2.9e-2 from the
reference (docs/perf.md), while the output and the q/k/v/beta gradients agree within ~5e-3. The chain rule
around the kernels is checked on CPU, so this looks at the kernels' own outputs: cuDNN-FE's Hopper backward
(``kda_hopper_cuda``) is given the adapter's preprocessed inputs (L2-normalised bf16 q/k, fp32 log-decay g,
fp32 beta), and its dq_n, dk_n, dv, dg and dbeta are compared with autograd through ``kda_reference`` on the
same inputs in fp32 (no gate, no l2norm: exactly the kernel's contract). Then the same dg through the adapter's
chain rule to du, against the reference's du. Relative error = ||a - b|| / ||b||. Needs CUDA on sm90 with the
cuDNN frontend 1.32 engine.

    PYTHONPATH=$PWD:/tmp/site python3 scripts/check/cudnn_kda_gradients.py [--tokens 1024 --heads 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowerings.kernels import cudnn_kda  # noqa: E402
from lowerings.ops.kda_reference import kda_gate, kda_reference  # noqa: E402

K = 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    if (reason := cudnn_kda.machine_reason()) is not None:
        print(f"cuDNN KDA cannot run here: {reason}")
        return 1
    T, H = opts.tokens, opts.heads
    gen = torch.Generator(device="cuda").manual_seed(opts.seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q, k, v, u = (mk(1, T, H, K).bfloat16() for _ in range(4))
    beta = torch.rand(1, T, H, device="cuda", generator=gen)
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log()
    dt_bias = mk(H * K) * 0.1
    lower_bound = -5.0
    bounds = [0, T // 10, T // 3, T]
    cu = torch.tensor(bounds + [T] * (64 - len(bounds) + 1), device="cuda", dtype=torch.int32)
    d_o = mk(1, T, H, K).bfloat16()

    prep = cudnn_kda.preprocess(q, k, u, beta, A_log, dt_bias, lower_bound)
    _, backward = cudnn_kda._cudnn_kernels()
    thd = cudnn_kda._thd
    dq_n, dk_n, dv, dg, dbeta, *_ = backward(
        thd(d_o), thd(prep.q_n), thd(prep.k_n), thd(v), thd(prep.g), thd(prep.beta), cu, K**-0.5,
        plan_name=cudnn_kda.PLAN)

    # the reference on the kernel's own contract, fp32 leaves from the very same (rounded) inputs
    leaves = [t.detach().float().requires_grad_() for t in (prep.q_n, prep.k_n, v, prep.g, prep.beta)]
    o, _ = kda_reference(*leaves, None, None, None, K**-0.5, cu, None, False, False)
    o.backward(d_o.float())
    shape = (1, T, H)
    got = {"dq_n": dq_n.view(*shape, K), "dk_n": dk_n.view(*shape, K), "dv": dv.view(*shape, K),
           "dg": dg.view(*shape, K), "dbeta": dbeta.view(shape)}
    print(f"T={T}, H={H}, K={K}, documents {bounds}; relative error of cuDNN's backward against the fp32 "
          "reference's autograd on the same inputs")
    print("| gradient | dtype | rel err |\n|---|---|---:|")
    for (name, value), leaf in zip(got.items(), leaves):
        print(f"| {name} | {value.dtype} | {rel_err(value.float(), leaf.grad):.2e} |")

    # dg through the adapter's chain rule, against the reference's du (autograd through the gate)
    u_leaf = u.detach().float().requires_grad_()
    kda_gate(u_leaf, A_log, dt_bias, lower_bound).backward(leaves[3].grad)
    du, _, ddt = cudnn_kda.gate_bwd_torch(u, A_log, dt_bias, got["dg"], lower_bound)
    du_ref, _, ddt_ref = cudnn_kda.gate_bwd_torch(u, A_log, dt_bias, leaves[3].grad, lower_bound)
    print(f"| du (cuDNN dg, chain rule) | {du.dtype} | {rel_err(du.float(), u_leaf.grad):.2e} |")
    print(f"| du (reference dg, chain rule) | {du_ref.dtype} | {rel_err(du_ref.float(), u_leaf.grad):.2e} |")
    print(f"| ddt_bias (cuDNN dg) | {ddt.dtype} | {rel_err(ddt.float(), ddt_ref.float()):.2e} |")

    # fla's chunk_kda on the very same bf16 inputs: is cuDNN's dg worse than the backend `auto` uses?
    from fla.ops.kda import chunk_kda

    fla_leaves = [t.detach().clone().requires_grad_() for t in (prep.q_n, prep.k_n, v, prep.g, prep.beta)]
    o_fla, _ = chunk_kda(*fla_leaves, scale=K**-0.5, cu_seqlens=torch.tensor(bounds, device="cuda"))
    o_fla.backward(d_o.to(o_fla.dtype))
    print("\nfla 0.6.0 chunk_kda's backward on the same inputs, against the same fp32 reference")
    print("| gradient | dtype | rel err |\n|---|---|---:|")
    for name, leaf, ref in zip(got, fla_leaves, leaves):
        print(f"| {name} | {leaf.grad.dtype} | {rel_err(leaf.grad.float(), ref.grad):.2e} |")
    du_fla, _, ddt_fla = cudnn_kda.gate_bwd_torch(u, A_log, dt_bias, fla_leaves[3].grad.float(), lower_bound)
    print(f"| du (fla dg, chain rule) | {du_fla.dtype} | {rel_err(du_fla.float(), u_leaf.grad):.2e} |")
    print(f"| ddt_bias (fla dg) | {ddt_fla.dtype} | {rel_err(ddt_fla.float(), ddt_ref.float()):.2e} |")
    print(f"| dg cuDNN vs fla | | {rel_err(got['dg'].float(), fla_leaves[3].grad.float()):.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
