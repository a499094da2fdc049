"""Adapter from ``titan_kimi::kda_cp`` to FLA 0.6.0's context-parallel chunked KDA (wrapped, not rewritten).

FLA's context parallelism takes one packed row (batch 1): ``build_cp_context`` turns the row's global
``cu_seqlens`` into this rank's local segments and the chain metadata (``layout`` "contiguous" or "zigzag",
which match ``lowerings.ops.sequence_shards``), and ``chunk_kda_fwd``/``chunk_kda_bwd`` all-gather the
per-rank state maps themselves. Rows of a batch run one after the other, each with its own context. Besides
the residuals of the one-rank adapter (``fla_kda``: the inverse norms of q and k, Aqk and Akk; the backward
rebuilds the normalised q and k from them), the forward keeps the incoming state FLA computed (``compress_h0``:
one per part), which its backward needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowerings.kernels.fla_kda import CHUNK, _safe_gate, normalised
from lowerings.ops.sequence_shards import parts_per_rank


def _row_contexts(cu_seqlens: torch.Tensor, rows: int, group: dist.ProcessGroup, layout: str, device):
    """One FLACPContext per row, from the batch's global cu_seqlens (one host copy for all rows)."""
    from fla.ops.cp import build_cp_context

    cu = cu_seqlens.cpu().long()
    total = int(cu[-1])
    if total % rows:
        raise ValueError(f"kda_cp: {total} global tokens do not split into {rows} equal rows")
    length = total // rows
    contexts = []
    for b in range(rows):
        row = cu[(cu >= b * length) & (cu <= (b + 1) * length)] - b * length
        contexts.append(build_cp_context(row.to(device), group=group, cu_seqlens_cpu=row, layout=layout))
    return contexts


def _chunk_indices(ctx):
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(ctx.cu_seqlens.long(), CHUNK, cu_seqlens_cpu=ctx.cu_seqlens_cpu.long())


def fla_kda_cp_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, group, layout):
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    B, _, H, K = q.shape
    outs, residuals = [], [[] for _ in range(5)]
    for b, ctx in enumerate(_row_contexts(cu_seqlens, B, group, layout, q.device)):
        qb, kb, vb, gb, betab = (t[b:b + 1].contiguous() for t in (q, k, v, g, beta))
        q_n, q_rstd = l2norm_fwd(qb)
        k_n, k_rstd = l2norm_fwd(kb)
        o, _, _, Aqk, Akk, *_, h0 = chunk_kda_fwd(
            q=q_n, k=k_n, v=vb, g=gb, beta=betab.float(), scale=scale, initial_state=None,
            output_final_state=False, cu_seqlens=ctx.cu_seqlens.long(), cu_seqlens_cpu=ctx.cu_seqlens_cpu.long(),
            chunk_indices=_chunk_indices(ctx), chunk_size=CHUNK, safe_gate=_safe_gate(lower_bound),
            lower_bound=lower_bound, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            disable_recompute=False, cp_context=ctx,
        )
        if h0 is None:  # FLA returns None only without a CP group; keep the residual's shape
            h0 = q.new_zeros(parts_per_rank(layout), H, K, v.shape[-1], dtype=torch.float32)
        outs.append(o.to(v.dtype))
        for slot, t in zip(residuals, (q_rstd, k_rstd, Aqk, Akk, h0.float().unsqueeze(0))):
            slot.append(t)
    return torch.cat(outs), [torch.cat(slot) for slot in residuals]


def fla_kda_cp_backward(d_o, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, group, layout,
                        residuals):
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd

    q_rstd, k_rstd, Aqk, Akk, h0 = residuals
    q_n, k_n = normalised(q, q_rstd), normalised(k, k_rstd)
    grads = [[] for _ in range(5)]
    dA = ddt = None
    for b, ctx in enumerate(_row_contexts(cu_seqlens, q.shape[0], group, layout, q.device)):
        row = slice(b, b + 1)
        dq, dk, dv, db, dg, _, dA_b, ddt_b = chunk_kda_bwd(
            q=q_n[row], k=k_n[row], v=v[row].contiguous(), beta=beta[row].float().contiguous(), Aqk=Aqk[row],
            Akk=Akk[row], scale=scale, initial_state=h0[b], do=d_o[row].contiguous(), dht=None, g=None,
            g_org=g[row].contiguous(), cu_seqlens=ctx.cu_seqlens.long(), chunk_indices=_chunk_indices(ctx),
            chunk_size=CHUNK, safe_gate=_safe_gate(lower_bound), lower_bound=lower_bound, use_gate_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, disable_recompute=False, cp_context=ctx,
        )
        dq = l2norm_bwd(q_n[row], q_rstd[row], dq)
        dk = l2norm_bwd(k_n[row], k_rstd[row], dk)
        for slot, t, like in zip(grads, (dq, dk, dv, dg, db), (q, k, v, g, beta)):
            slot.append(t.to(like.dtype))
        dA = dA_b if dA is None else dA + dA_b
        if dt_bias is not None:
            ddt = ddt_b if ddt is None else ddt + ddt_b
    out = [torch.cat(slot) for slot in grads] + [dA.to(A_log.dtype)]
    if dt_bias is not None:
        out.append(ddt.to(dt_bias.dtype))
    return out
