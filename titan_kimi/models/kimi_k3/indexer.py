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
        k = self.k_norm(self.wk(x)).view(T, self.head_dim)
        w = self.weights_proj(x).float().view(T, self.n_heads) * (self.n_heads**-0.5)
        return ops.indexer_topk(q, k, w, seq.flat_seg_start, topk=self.topk, scale=1.0 / math.sqrt(self.head_dim))

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init_linear(linear, self.init_std)
        self.k_norm.init_weights()
