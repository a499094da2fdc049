"""Pure-PyTorch references of the indexer-distillation ops (``lowerings/ops/indexer_kl.py``), on any device.

Notation: the main attention is the absorbed latent (MQA) form of the DSA layers, ``q [T,H,D]`` against one
shared ``kv [Tk,D]`` with softmax scale ``scale`` and per-head log-sum-exp ``lse [T,H]`` (natural log); the
indexer has queries ``iq [T,HI,Di]``, one key head ``ik [Tk,Di]``, weights ``iw [T,HI]`` (already scaled) and
``I(t,s) = sum_h iw[t,h] relu(index_scale iq[t,h].ik[s])``.

Target at query t over a key set K_t: ``u(t,s) = sum_h exp(scale q[t,h].kv[s] - lse[t,h])``, ``p = u / sum_K u``
(head-summed attention probabilities, L1-normalised over the keys used). KL_t = sum_K p (log p - log softmax_K I).

Everything runs in row chunks whose largest fp32 intermediate (``[rows, heads, keys]``) stays under
``CHUNK_BYTES``: no ``[T, T]`` per-head tensor exists, and the dense forms see, per chunk, only the key window its
rows can reach.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 28


def _row_chunks(T: int, per_row_bytes: int) -> list[slice]:
    rows = max(1, CHUNK_BYTES // max(1, per_row_bytes))
    return [slice(r, min(T, r + rows)) for r in range(0, T, rows)]


def _key_window(seg_start: torch.Tensor, rows: slice, q_offset: int) -> tuple[int, int]:
    """Keys [lo, hi) the queries in ``rows`` can see (seg_start is nondecreasing within a row of the batch, but
    flat batches restart it per row, so the minimum is read, not the first)."""
    return int(seg_start[rows].min()), q_offset + rows.stop


def _dense_mask(seg_start: torch.Tensor, rows: slice, lo: int, hi: int, q_offset: int) -> torch.Tensor:
    t = torch.arange(rows.start + q_offset, rows.stop + q_offset, device=seg_start.device).unsqueeze(1)
    s = torch.arange(lo, hi, device=seg_start.device).unsqueeze(0)
    return (s <= t) & (s >= seg_start[rows].unsqueeze(1).long())


def _indexer_scores(iq: torch.Tensor, keys: torch.Tensor, iw: torch.Tensor, index_scale: float,
                    equation: str) -> torch.Tensor:
    logits = torch.einsum(equation, iq.float(), keys.float()) * index_scale
    return (iw.float().unsqueeze(-1) * torch.relu(logits)).sum(1)


def _head_mass(q: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scale: float, valid: torch.Tensor,
               equation: str) -> torch.Tensor:
    """u = sum_h exp(scale q.k - lse) at the valid keys (0 elsewhere); ``lse = -inf`` rows give 0."""
    logits = torch.einsum(equation, q.float(), keys.float()) * scale - lse.float().unsqueeze(-1)
    u = torch.exp(logits.masked_fill(~valid.unsqueeze(1), float("-inf"))).sum(1)
    return torch.nan_to_num(u, nan=0.0, posinf=0.0)


def row_kl(p: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(scores)) per row over the valid columns; rows without a valid column (or without target
    mass) give 0. Differentiable in ``scores``."""
    masked = scores.masked_fill(~valid, float("-inf"))
    # a row with no valid column would be all -inf: NaN through log_softmax and its backward
    masked = torch.where(valid.any(-1, keepdim=True), masked, torch.zeros_like(masked))
    log_q = torch.log_softmax(masked, dim=-1)
    log_p = torch.log(p.clamp(min=torch.finfo(torch.float32).tiny))
    terms = torch.where(valid & (p > 0), p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(-1)


def row_kl_score_grad(p: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """d row_kl(p, scores, valid) / d scores, closed form: ``(sum p) softmax(scores) - p`` on the valid columns
    (0 elsewhere and on rows without a valid column)."""
    masked = scores.masked_fill(~valid, float("-inf"))
    masked = torch.where(valid.any(-1, keepdim=True), masked, torch.zeros_like(masked))
    q = torch.softmax(masked, dim=-1)
    p = torch.where(valid, p, torch.zeros_like(p))
    return torch.where(valid, p.sum(-1, keepdim=True) * q - p, torch.zeros_like(p))


def normalise(u: torch.Tensor) -> torch.Tensor:
    total = u.sum(-1, keepdim=True)
    return torch.where(total > 0, u / total.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(u))


# ---------------------------------------------------------------- the selected keys (sparse stage)
def sparse_target_reference(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """p [T,k] fp32 at the slots of ``idx [T,k]`` (0 at -1 slots)."""
    T, H, D = q.shape
    out = []
    for rows in _row_chunks(T, 4 * idx.shape[1] * (H + D)):
        sel = idx[rows]
        valid = sel >= 0
        keys = kv[sel.long().clamp(min=0)]  # [R, k, D]
        out.append(normalise(_head_mass(q[rows], keys, lse[rows], scale, valid, "thd,tkd->thk")))
    return torch.cat(out) if out else q.new_zeros((0, idx.shape[1]), dtype=torch.float32)


def scores_at_reference(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, idx: torch.Tensor,
                        index_scale: float) -> torch.Tensor:
    """I [T,k] fp32 at the slots of ``idx`` (-inf at -1 slots). Differentiable in iq, ik, iw (plain torch)."""
    T, HI, Di = iq.shape
    out = []
    for rows in _row_chunks(T, 4 * idx.shape[1] * (HI + Di)):
        sel = idx[rows]
        keys = ik[sel.long().clamp(min=0)]
        scores = _indexer_scores(iq[rows], keys, iw[rows], index_scale, "thd,tkd->thk")
        out.append(scores.masked_fill(sel < 0, float("-inf")))
    return torch.cat(out) if out else iq.new_zeros((0, idx.shape[1]), dtype=torch.float32)


# ---------------------------------------------------------------- every causal key (dense warm-up)
def attention_lse_reference(q: torch.Tensor, kv: torch.Tensor, seg_start: torch.Tensor, scale: float,
                            q_offset: int = 0) -> torch.Tensor:
    """lse [T,H] of ``scale q.kv`` over each query's causal keys of its document."""
    T, H, _ = q.shape
    out = []
    for rows in _row_chunks(T, 4 * H * (q_offset + T)):
        lo, hi = _key_window(seg_start, rows, q_offset)
        valid = _dense_mask(seg_start, rows, lo, hi, q_offset)
        logits = torch.einsum("thd,sd->ths", q[rows].float(), kv[lo:hi].float()) * scale
        out.append(torch.logsumexp(logits.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1))
    return torch.cat(out) if out else q.new_zeros((0, H), dtype=torch.float32)


def _dense_chunk(q, kv, lse, seg_start, rows, q_offset, scale):
    """(p, valid, key window) of one row chunk."""
    lo, hi = _key_window(seg_start, rows, q_offset)
    valid = _dense_mask(seg_start, rows, lo, hi, q_offset)
    return normalise(_head_mass(q[rows], kv[lo:hi], lse[rows], scale, valid, "thd,sd->ths")), valid, slice(lo, hi)


def _scores_backward(d_scores: torch.Tensor, iq: torch.Tensor, keys: torch.Tensor, iw: torch.Tensor,
                     index_scale: float, per_query_keys: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum d_scores * I in (iq, keys, iw), written out (op bodies run below autograd, and a compile
    may run a backward op inside the forward graph, where torch.func transforms cannot reach the storage):
    I = sum_h w_h relu(l_h), l_h = index_scale q_h.k; dw_h = sum_s dI relu(l_h); dl_h = dI w_h [l_h > 0]."""
    eq_l, eq_q, eq_k = (("thd,tkd->thk", "thk,tkd->thd", "thk,thd->tkd") if per_query_keys
                        else ("thd,sd->ths", "ths,sd->thd", "ths,thd->sd"))
    logits = torch.einsum(eq_l, iq.float(), keys.float()) * index_scale
    d_w = (d_scores.unsqueeze(1) * torch.relu(logits)).sum(-1)
    d_logits = d_scores.unsqueeze(1) * iw.float().unsqueeze(-1) * (logits > 0) * index_scale
    return torch.einsum(eq_q, d_logits, keys.float()), torch.einsum(eq_k, d_logits, iq.float()), d_w


def dense_kl_reference(iq, ik, iw, q, kv, lse, seg_start, q_offset: int, index_scale: float,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL_t [T] fp32 over every causal key of each query's document, and [T, 2] (the LSE of the indexer's
    scores, the target's total mass) as the fused kernel keeps them for its backward."""
    T = q.shape[0]
    per_row = 4 * max(q.shape[1], iq.shape[1]) * (q_offset + T)
    kls, stats = [], []
    for rows in _row_chunks(T, per_row):
        lo, hi = _key_window(seg_start, rows, q_offset)
        valid = _dense_mask(seg_start, rows, lo, hi, q_offset)
        u = _head_mass(q[rows], kv[lo:hi], lse[rows], scale, valid, "thd,sd->ths")
        scores = _indexer_scores(iq[rows], ik[lo:hi], iw[rows], index_scale, "thd,sd->ths")
        kls.append(row_kl(normalise(u), scores, valid))
        stats.append(torch.stack([torch.logsumexp(scores.masked_fill(~valid, float("-inf")), -1), u.sum(-1)], -1))
    if not kls:
        return q.new_zeros((0,), dtype=torch.float32), q.new_zeros((0, 2), dtype=torch.float32)
    return torch.cat(kls), torch.cat(stats)


def dense_kl_backward_reference(grad: torch.Tensor, iq, ik, iw, q, kv, lse, seg_start, q_offset: int,
                                index_scale: float, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum_t grad[t] KL_t in iq, ik, iw: per chunk dKL/dI = grad (softmax(I) - p) at the valid keys,
    then the scores' gradients (recomputed)."""
    T = q.shape[0]
    diq, dik, diw = (torch.zeros_like(t, dtype=torch.float32) for t in (iq, ik, iw))
    per_row = 4 * max(q.shape[1], iq.shape[1]) * (q_offset + T)
    for rows in _row_chunks(T, per_row):
        p, valid, window = _dense_chunk(q, kv, lse, seg_start, rows, q_offset, scale)
        scores = _indexer_scores(iq[rows], ik[window], iw[rows], index_scale, "thd,sd->ths")
        soft = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        d_scores = torch.where(valid, grad[rows].float().unsqueeze(-1) * (soft - p), torch.zeros_like(p))
        g_q, g_k, g_w = _scores_backward(d_scores, iq[rows], ik[window], iw[rows], index_scale, False)
        diq[rows] += g_q
        dik[window] += g_k
        diw[rows] += g_w
    return diq.to(iq.dtype), dik.to(ik.dtype), diw.to(iw.dtype)


def scores_at_backward_reference(d_scores: torch.Tensor, iq, ik, iw, idx, index_scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of sum d_scores * I(idx) in iq, ik, iw (-1 slots contribute nothing)."""
    T, HI, Di = iq.shape
    diq, dik, diw = (torch.zeros_like(t, dtype=torch.float32) for t in (iq, ik, iw))
    for rows in _row_chunks(T, 4 * idx.shape[1] * (HI + Di)):
        sel = idx[rows]
        keys = ik[sel.long().clamp(min=0)]
        d = torch.where(sel >= 0, d_scores[rows].float(), torch.zeros_like(d_scores[rows], dtype=torch.float32))
        g_q, g_k, g_w = _scores_backward(d, iq[rows], keys, iw[rows], index_scale, True)
        diq[rows] = g_q
        diw[rows] = g_w
        dik.index_add_(0, sel.long().clamp(min=0).reshape(-1), g_k.reshape(-1, Di))
    return diq.to(iq.dtype), dik.to(ik.dtype), diw.to(iw.dtype)
