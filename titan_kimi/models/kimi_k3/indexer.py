"""K3.1 DSA indexer (spec §16a): scores every causal key of the document and keeps the top-k per query.

Frozen by default; ``index_training`` = warmup / sparse trains it by distillation
(``titan_kimi.models.kimi_k3.indexer_distillation``)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init_specs import init_linear
from titan_kimi.models.kimi_k3.norms import FP32LayerNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, query_runs


class Indexer(nn.Module):
    """I(t,s) = sum_h w[t,h] ReLU(d^-1/2 q_I[t,h].k_I[s]) with w = weights_proj(x) H_I^-1/2 (no RoPE)."""

    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.topk = args.index_topk
        self.init_std = args.init_std
        self.training_mode = args.index_training  # frozen | warmup | sparse
        self.layers_with_indexer = len(args.full_attn_layers)  # every gated MLA layer of a K3.1 model
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.head_dim, bias=False)
        self.k_norm = FP32LayerNorm(self.head_dim, eps=args.index_norm_eps)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        # Frozen unless it trains by distillation: hard top-k gives the LM loss no gradient (spec §16b).
        self.requires_grad_(args.indexer_trains)
        # [KL sum, queries, recall sum, queries with more causal keys than top-k] of the distillation since the
        # trainer last read them (titan_kimi.training.reports.indexer_metrics). Not persistent: not a weight.
        self.register_buffer("distillation_stats", torch.zeros(4, dtype=torch.float32), persistent=False)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B,S,D]``, ``q_latent [B,S,q_lora]`` -> queries ``[T,HI,d]``, keys ``[T,d]`` and weights ``[T,HI]``
        (fp32, with the H_I^-1/2 factor). The inputs are detached: the indexer never shapes the main model's
        graph (hard top-k passes no gradient; a distillation loss trains the indexer alone)."""
        T = x.shape[0] * x.shape[1]
        x, q_latent = x.detach(), q_latent.detach()
        q = self.wq_b(q_latent).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(T, self.head_dim)
        w = self.weights_proj(x).float().view(T, self.n_heads) * (self.n_heads**-0.5)
        return q, k, w

    @property
    def trains(self) -> bool:
        return self.training_mode != "frozen"

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def row_keys(self, k: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        """The keys every query of a row may read, ``[B, row length, d]``: the whole row's under context
        parallelism (gathered, differentiable), else the local ones."""
        keys = k.view(seq.batch, seq.seq_len, self.head_dim)
        return keys if seq.exchange is None else seq.exchange.gather(keys)

    def select(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        """Top-k keys per query from `project`'s outputs: flat indices ``[B*S, k]`` into the rows' keys (the
        whole rows' under context parallelism)."""
        if seq.exchange is None:
            # cu_seqlens and the row length let per-document backends score each query against its document only
            bound = seq.seq_len if seq.cu_seqlens is not None else 0
            return ops.indexer_topk(q, k, w, seq.flat_seg_start, topk=self.topk, scale=self.scale,
                                    cu_seqlens=seq.cu_seqlens, max_seqlen=bound)
        return self._context_parallel(q, self.row_keys(k, seq), w, seq)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        """``x [B,S,D]`` (the normalised layer input) and ``q_latent [B,S,q_lora]`` -> flat indices ``[B*S, k]``."""
        return self.select(*self.project(x, q_latent), seq)

    def _context_parallel(self, q, keys, w, seq: SequenceInfo) -> torch.Tensor:
        """Each local piece of each row scores the whole row's keys from its global position: the top-k runs
        over global key indices, document-causal across ranks; the scores stay chunked inside the op."""
        ex = seq.exchange
        out = []
        for run in query_runs(seq):
            b = run.row
            idx = ops.indexer_topk(q[run.rows], keys[b], w[run.rows], run.seg_start, topk=self.topk,
                                   scale=self.scale, q_offset=run.q_offset)
            out.append(torch.where(idx >= 0, idx + b * ex.global_len, idx))  # flat over all rows' keys
        return torch.cat(out, dim=0)

    def record(self, kl_sum: torch.Tensor, queries: torch.Tensor, mass_sum: torch.Tensor,
               mass_queries: torch.Tensor) -> None:
        """Add one forward's distillation statistics (sums and counts; their ratios survive activation
        recomputation adding them twice) to `distillation_stats`, which the trainer reads and resets."""
        with torch.no_grad():
            self.distillation_stats.add_(torch.stack([kl_sum, queries, mass_sum, mass_queries]).float())

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init_linear(linear, self.init_std)
        self.k_norm.init_weights()
        self.distillation_stats.zero_()
