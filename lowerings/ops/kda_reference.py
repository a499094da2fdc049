"""Pure-PyTorch Kimi Delta Attention (chunked gated delta rule) that runs on CPU.

Per sequence and head, with state S in R^{K x V} (fp32, S_0 = 0 or the initial state):
    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t.

Chunked (WY) form over chunks of C tokens, with G the chunk-local cumulative log decay: the per-token updates
u_t = beta_t (v_t - S_bar_t^T k_t) solve a unit lower-triangular system. Everything within a chunk is computed
for all chunks at once; only the state passes from chunk to chunk. With a lower-bounded gate (|g| <= |lb|), the
decayed scores factor as exp(G_t - G_last) exp(G_last - G_i), both finite in fp32 while |lb| C stays under
FACTORED_LOG_RANGE; any other gate takes every decay as exp(G_t - G_i) with i <= t (never exp of a positive
number), safe for gates of any strength. Document boundaries are masks, not loops: pairs in different segments
do not interact, and the carried state only reaches tokens whose segment began before the chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 8
L2NORM_EPS = 1e-6
# The largest |log decay| over a chunk for which exp(+-G) stays well inside fp32 (exp(88) overflows).
FACTORED_LOG_RANGE = 60.0


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(u: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None) -> torch.Tensor:
    """Log-space forget gate from the raw input u [..., H, K]: lb * sigmoid(exp(A_log) (u + dt_bias))."""
    H, K = u.shape[-2:]
    x = u.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _segment_starts_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)


def _independent_row_length(cu_seqlens: torch.Tensor, total: int) -> int:
    """The shortest length L (a multiple of CHUNK dividing ``total``) at whose every multiple a segment starts:
    the packed tokens are then ``total // L`` independent rows of L, which the chunk recurrence runs side by
    side (the same sums, far fewer sequential steps). ``total`` when there is none."""
    starts = set(cu_seqlens.tolist()[:-1])
    for L in range(CHUNK, total, CHUNK):
        if total % L == 0 and all(r in starts for r in range(0, total, L)):
            return L
    return total


def _chunked_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    seg_start: torch.Tensor | None,
    state: torch.Tensor,
    gate_floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 chunked recurrence over rows. q,k,g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; state [B,H,K,V].

    seg_start [B,T] (row-local first index of each token's segment) or None for one sequence per row. A
    negative start marks a segment that began before the row: only its tokens see ``state``; without one the
    initial state reaches nobody. ``gate_floor``: a bound on |g| per token when the gate has one (the
    lower-bounded gate), which lets the scores factor. Returns o [B,T,H,V] and the state after the last token
    (of its segment).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    pad = (-T) % C
    if pad:
        # Padded tail: k = v = beta = g = 0 leaves the state unchanged; it joins the last segment.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
        if seg_start is not None:
            seg_start = torch.cat([seg_start, seg_start[:, -1:].expand(B, pad)], dim=1)
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B,T,H,D] -> [B,H,N,C,D]
        return x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)  # [B,H,N,C,D]
    Gc = chunks(g).cumsum(dim=3)
    bc = beta.view(B, N, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [B,H,N,C,1]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    if seg_start is None:
        m_incl, m_strict = incl, strict
        carry = torch.ones(1, 1, 1, C, 1, dtype=q.dtype, device=q.device)
        end_mask = torch.ones(1, 1, 1, C, 1, dtype=torch.bool, device=q.device)
    else:
        sc = seg_start.view(B, N, C)
        chunk_first = torch.arange(N, device=q.device).view(1, N, 1) * C
        carry = (sc < chunk_first).to(q.dtype).view(B, 1, N, C, 1)  # the token's segment began before the chunk
        same = (sc[..., :, None] == sc[..., None, :]).unsqueeze(1)  # [B,1,N,C,C]
        m_incl, m_strict = incl & same, strict & same
        end_mask = same[..., C - 1, :].unsqueeze(-1)  # tokens in the chunk's last token's segment

    # Everything within a chunk, for all chunks at once: the decayed scores and the WY solve, whose
    # right-hand side is linear in the incoming state S: U = L^-1 (beta v) - L^-1 (beta k gamma) S.
    to_end = Gc[:, :, :, C - 1 :, :] - Gc  # [B,H,N,C,K] = G_last - G_t <= 0
    if gate_floor is not None and abs(gate_floor) * C <= FACTORED_LOG_RANGE:
        # A bounded gate: exp(G_t - G_i) = exp(G_t - G_last) exp(G_last - G_i), each factor finite in fp32,
        # so the scores are two matmuls instead of a [C, C, K] tensor per chunk.
        k_decayed = (kc * to_end.exp()).transpose(-1, -2)  # k_i exp(G_last - G_i)
        A_kk = (kc * (-to_end).exp()) @ k_decayed * m_strict
        A_qk = (qc * (-to_end).exp()) @ k_decayed * m_incl
    else:  # every factor exp(G_t - G_i) with i <= t: safe for any gate
        diff = Gc.unsqueeze(4) - Gc.unsqueeze(3)  # [B,H,N,C(t),C(i),K] = G_t - G_i
        decay_incl = diff.masked_fill(~m_incl.unsqueeze(-1), float("-inf")).exp()
        A_kk = torch.einsum("bhntk,bhnik,bhntik->bhnti", kc, kc, decay_incl * m_strict.unsqueeze(-1))
        A_qk = torch.einsum("bhntk,bhnik,bhntik->bhnti", qc, kc, decay_incl)
    gamma = Gc.exp() * carry  # decay since chunk start, only for tokens that see the carried state
    L = torch.eye(C, dtype=q.dtype, device=q.device) + bc * A_kk
    X = torch.linalg.solve_triangular(L, torch.cat([bc * vc, bc * (kc * gamma)], dim=-1), upper=False,
                                      unitriangular=True)
    X_v, X_k = X.split([V, K], dim=-1)
    k_to_end = kc * to_end.masked_fill(~end_mask, float("-inf")).exp()  # [B,H,N,C,K]
    state_decay = (Gc[:, :, :, C - 1].exp() * carry[:, :, :, C - 1]).unsqueeze(-1)  # [B,H,N,K,1]

    # The only sequential part: the state through the chunks (two small matmuls each).
    states, us = [], []
    for n in range(N):
        u = X_v[:, :, n] - X_k[:, :, n] @ state
        states.append(state)
        us.append(u)
        state = state * state_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    S, U = torch.stack(states, dim=2), torch.stack(us, dim=2)
    out = scale * ((qc * gamma) @ S + A_qk @ U)  # [B,H,N,C,V]
    o = out.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)
    return o[:, :T], state


def _fp32_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
                 l2norm_qk: bool) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) as the recurrence takes them: fp32, q and k l2-normalised when asked, g the log-space
    gate of the raw input when ``A_log`` is given (else used as given)."""
    qf, kf, vf, bf = q.float(), k.float(), v.float(), beta.float()
    if l2norm_qk:
        qf, kf = l2norm(qf), l2norm(kf)
    gf = kda_gate(g, A_log, dt_bias, lower_bound) if A_log is not None else g.float()
    return qf, kf, vf, gf, bf


def gate_floor(A_log: torch.Tensor | None, lower_bound: float | None) -> float | None:
    """The bound on |log decay| per token that the gate guarantees: lower_bound * sigmoid(...) lies within
    lower_bound of 0; the softplus gate and a gate given as is have none."""
    return lower_bound if A_log is not None and lower_bound is not None else None


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kda`` op contract (docs/ops.md) in plain PyTorch; differentiable through autograd."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gf, bf = _fp32_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, l2norm_qk)
    floor = gate_floor(A_log, lower_bound)
    if cu_seqlens is None:
        state = initial_state.float() if initial_state is not None else qf.new_zeros(B, H, K, V)
        o, final = _chunked_rows(qf, kf, vf, gf, bf, scale, None, state, floor)
    elif initial_state is None and not output_final_state:
        L = _independent_row_length(cu_seqlens, T) if q.device.type == "cpu" else T
        R = T // L
        seg = _segment_starts_from_cu_seqlens(cu_seqlens, T).view(R, L)
        seg = seg - torch.arange(0, T, L, device=seg.device).view(R, 1)  # row-local starts
        rows = [x.reshape(R, L, *x.shape[2:]) for x in (qf, kf, vf, gf, bf)]
        o, final = _chunked_rows(*rows, scale, seg, qf.new_zeros(R, H, K, V), floor)
        o = o.reshape(1, T, H, V)
    else:
        # States per sequence: run each sequence as its own row (rare path: context parallelism).
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for n in range(len(bounds) - 1):
            a, b = bounds[n], bounds[n + 1]
            s0 = initial_state[n : n + 1].float() if initial_state is not None else qf.new_zeros(1, H, K, V)
            o_n, f_n = _chunked_rows(qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b], scale, None, s0,
                                     floor)
            outs.append(o_n)
            finals.append(f_n)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    if not output_final_state:
        final = qf.new_zeros(0)
    return o.to(v.dtype).contiguous(), final


def kda_rows_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    scale: float,
    seg_start: torch.Tensor,
    initial_state: torch.Tensor,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of packed segments with one incoming state per row (context parallelism's pieces of a sequence).

    ``seg_start [B,T]``: row-local start of each token's segment, -1 for the segment that continues from before
    the row, which alone starts from ``initial_state [B,H,K,V]``. Returns ``o [B,T,H,V]`` and the state after
    each row's last token, both fp32 (the caller adds to o before rounding). Differentiable through autograd.
    """
    qf, kf, vf, gf, bf = _fp32_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, l2norm_qk)
    o, final = _chunked_rows(qf, kf, vf, gf, bf, scale, seg_start, initial_state.float(),
                             gate_floor(A_log, lower_bound))
    return o, final
