"""Adapter from the ``titan_kimi::kda`` op contract to FLA 0.6.0's chunked KDA kernels (wrapped, not rewritten).

The forward hands the op what FLA's own autograd Function saves, as residuals: the intra-chunk matrices
Aqk/Akk and the inverse norms of q and k, so the backward runs FLA's backward without recomputing the forward.
The normalised q and k themselves are not kept: the backward rebuilds them bit for bit from q, k (saved anyway)
and the inverse norms (FLA's l2norm stores the fp32 ``x * rstd`` rounded to x's dtype), which halves what a
checkpointing policy that keeps the op's outputs holds per KDA layer. The gate is computed inside FLA's kernels
(``use_gate_in_kernel``).
"""

from __future__ import annotations

import torch

from lowerings.kernels.fla_config_cache import use_shipped_fla_configs
from lowerings.settings import kernel_settings

CHUNK = 64
# The FLA modules the op calls, and the packages whose __init__ (every op family FLA ships) may wait: imported
# ahead by lowerings/kernels/quick_imports.py (titan_kimi.training.setup.kernels, the prewarm).
FLA_MODULES = ("fla.modules.norm.l2norm", "fla.ops.kda.chunk_fwd", "fla.ops.kda.chunk_bwd", "fla.ops.utils.index")
FLA_DEFERRED_PACKAGES = ("fla.ops", "fla.modules")
_fla_configs: str | None = None


def prepare_fla_configs() -> str:
    """Apply ``kernels.fla_configs`` once, before anything imports ``fla`` (FLA reads FLA_CACHE_MODE at import):
    ``shipped`` points FLA at the configs tuned for this GPU, ``autotune`` leaves FLA to tune. Returns a
    one-line description for the log; the train entry point calls it, and the first FLA call otherwise."""
    global _fla_configs
    if _fla_configs is None:
        if kernel_settings().fla_configs == "shipped":
            _fla_configs = use_shipped_fla_configs()
        else:
            _fla_configs = "fla configs: none (kernels.fla_configs = autotune), FLA autotunes"
    return _fla_configs


def _varlen_chunks(cu_seqlens: torch.Tensor | None, total_tokens: int) -> dict:
    """FLA's graph mode for packed rows: chunk indices built on the device with a static shape (one slot per
    possible chunk, sentinel rows that the kernels skip), so no kernel reads ``cu_seqlens`` on the host. The op
    then has no host sync and can be captured in a CUDA graph; zero-length tail segments (the padding of
    ``titan_kimi.models.kimi_k3.sequence.segment_slots``) are allowed. Returns FLA keyword arguments."""
    if cu_seqlens is None:
        return dict(cu_seqlens=None, chunk_indices=None)
    from fla.ops.utils.index import prepare_chunk_indices_static

    cu = cu_seqlens.long()
    max_chunks = -(-total_tokens // CHUNK) + cu.shape[0] - 2  # every segment may add one partial chunk
    chunk_indices, chunk_offsets = prepare_chunk_indices_static(cu, CHUNK, max_chunks)
    return dict(cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, use_graph=True)


def _safe_gate(lower_bound):
    # FLA's faster M=16 path needs the gate bounded in [lower_bound, 0) with lower_bound >= -5 (K3: -5).
    return lower_bound is not None and -5.0 <= lower_bound < 0


def residual_shapes(q: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the residuals the forward returns (for the op's fake implementation)."""
    # exactly what FLA returns (Inductor asserts sizes and strides): l2norm_fwd's inverse norms are [B, T, H]
    B, T, H, K = q.shape
    return [((B, T, H), torch.float32), ((B, T, H), torch.float32), ((B, T, H, CHUNK), q.dtype),
            ((B, T, H, CHUNK), q.dtype)]


def fla_kda_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens, initial_state,
                    output_final_state, l2norm_qk):
    prepare_fla_configs()
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    if not l2norm_qk or A_log is None:
        raise ValueError(
            f"the fla kda backend runs the K3 configuration (l2norm_qk=True and the gate computed in the kernel "
            f"from A_log); got l2norm_qk={l2norm_qk}, A_log given={A_log is not None}"
        )
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    q_n, q_rstd = l2norm_fwd(q)
    k_n, k_rstd = l2norm_fwd(k)
    o, final, _, Aqk, Akk, *_ = chunk_kda_fwd(
        q=q_n, k=k_n, v=v, g=g, beta=beta.float(), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        **_varlen_chunks(cu_seqlens, q.shape[1]), chunk_size=CHUNK, safe_gate=_safe_gate(lower_bound), lower_bound=lower_bound,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, disable_recompute=False,
    )
    if final is None:
        final = q.new_zeros(0, dtype=torch.float32)
    return o.to(v.dtype), final, [q_rstd, k_rstd, Aqk, Akk]


def normalised(x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """FLA's ``l2norm_fwd(x)`` output from its inverse norms: the same fp32 product, the same rounding."""
    return (x.float() * rstd.unsqueeze(-1)).to(x.dtype).contiguous()


def fla_kda_backward(d_o, d_final, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, cu_seqlens,
                     initial_state, output_final_state, l2norm_qk, residuals):
    prepare_fla_configs()
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd

    from lowerings.kernels.fla_graph_buffers import use_fresh_graph_buffers

    use_fresh_graph_buffers()  # FLA's graph mode would share one process-wide buffer set across layers

    q_rstd, k_rstd, Aqk, Akk = residuals
    q_n, k_n = normalised(q, q_rstd), normalised(k, k_rstd)
    dq, dk, dv, db, dg, dh0, dA, dbias = chunk_kda_bwd(
        q=q_n, k=k_n, v=v.contiguous(), beta=beta.float().contiguous(), Aqk=Aqk, Akk=Akk, scale=scale,
        initial_state=initial_state, do=d_o.contiguous(), dht=d_final if output_final_state else None,
        g=None, g_org=g.contiguous(), **_varlen_chunks(cu_seqlens, q.shape[1]), chunk_size=CHUNK,
        safe_gate=_safe_gate(lower_bound), lower_bound=lower_bound, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, disable_recompute=False,
    )
    dq = l2norm_bwd(q_n, q_rstd, dq)
    dk = l2norm_bwd(k_n, k_rstd, dk)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype)]
    if A_log is not None:
        grads.append(dA.to(A_log.dtype))
    if dt_bias is not None:
        grads.append(dbias.to(dt_bias.dtype))
    if initial_state is not None:
        grads.append(dh0.to(initial_state.dtype))
    return grads
