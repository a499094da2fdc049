"""K3.1 DSA indexer (spec §16a): scores every causal key of the document and keeps the top-k per query."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import init_linear
from titan_kimi.models.kimi_k3.norms import FP32LayerNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo


class Indexer(nn.Module):
    """I(t,s) = sum_h w[t,h] ReLU(d^-1/2 q_I[t,h].k_I[s]) with w = weights_proj(x) H_I^-1/2 (no RoPE)."""

    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.topk = args.index_topk
        self.init_std = args.init_std
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.head_dim, bias=False)
        self.k_norm = FP32LayerNorm(self.head_dim, eps=args.index_norm_eps)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        # Frozen by default: hard top-k gives the LM loss no gradient to train it with (spec §16b).
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        """``x [B,S,D]`` (the normalised layer input) and ``q_latent [B,S,q_lora]`` -> flat indices ``[B*S, k]``."""
        T = x.shape[0] * x.shape[1]
        # Hard top-k passes no gradient: the indexer never shapes the graph of the main model.
        x, q_latent = x.detach(), q_latent.detach()
        q = self.wq_b(q_latent).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        w = self.weights_proj(x).float().view(T, self.n_heads) * (self.n_heads**-0.5)
        scale = 1.0 / math.sqrt(self.head_dim)
        if seq.exchange is None:
            # cu_seqlens and the row length let per-document backends score each query against its document only
            bound = seq.seq_len if seq.cu_seqlens is not None else 0
            return ops.indexer_topk(q, k.view(T, self.head_dim), w, seq.flat_seg_start, topk=self.topk, scale=scale,
                                    cu_seqlens=seq.cu_seqlens, max_seqlen=bound)
        return self._context_parallel(q, k, w, seq, scale)

    def _context_parallel(self, q, k, w, seq: SequenceInfo, scale: float) -> torch.Tensor:
        """Each local piece of each row scores the whole row's keys from its global position: the top-k runs
        over global key indices, document-causal across ranks; the scores stay chunked inside the op."""
        ex = seq.exchange
        B, S = seq.batch, seq.seq_len
        keys = ex.gather(k)  # [B, global_len, D]
        piece = S // len(ex.part_starts)
        out = []
        for b in range(B):
            for p, start in enumerate(ex.part_starts):
                rows = slice(b * S + p * piece, b * S + (p + 1) * piece)
                idx = ops.indexer_topk(q[rows], keys[b], w[rows], seq.seg_start[b, p * piece:(p + 1) * piece],
                                       topk=self.topk, scale=scale, q_offset=start)
                out.append(torch.where(idx >= 0, idx + b * ex.global_len, idx))  # flat over all rows' keys
        return torch.cat(out, dim=0)

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init_linear(linear, self.init_std)
        self.k_norm.init_weights()
