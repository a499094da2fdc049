"""Gated multi-head latent attention (spec §4), and its K3.1 sparse form with the DSA indexer (§16a).

No RoPE anywhere: the 64-dim "rope" slices are ordinary extra dimensions, a key part shared by all heads
plus a per-head query part. Dense layers use the plain form; DSA layers use the absorbed latent form, in
which every head attends to the selected rows of the shared 576-dim latent ``[RMSNorm(c_kv) | k_r]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.indexer import Indexer
from titan_kimi.models.kimi_k3.indexer_distillation import distilled_attention
from titan_kimi.models.kimi_k3.init_specs import init_linear
from titan_kimi.models.kimi_k3.norms import RMSNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo
from titan_kimi.models.kimi_k3.weights import linear_weight


class GatedMLA(nn.Module):
    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.n_heads = n = args.n_heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        self.scale = self.qk_dim**-0.5
        self.init_std = args.init_std
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=args.mla_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, n * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(args.dim, n * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, args.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, eps=args.mla_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, args.dim, bias=False)
        self.g_proj = nn.Linear(args.dim, n * self.v_dim, bias=False) if args.mla_output_gate else None
        self.indexer = Indexer(args) if args.has_indexer else None

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hasattr(self, "q_proj"):
            return self.q_proj(x), None
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(q_latent), q_latent

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, S, _ = x.shape
        n = self.n_heads
        q, q_latent = self._queries(x)
        q = q.view(B, S, n, self.qk_dim)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        if seq.exchange is not None:
            # Context parallelism: only the compressed latent [c_kv | k_rope] (576 wide in K3) crosses ranks;
            # queries stay local and keys are expanded from the whole row's latent.
            latent = seq.exchange.gather(torch.cat([c_kv, k_rope], dim=-1))
            c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        if self.indexer is not None and self.indexer.trains:
            out = distilled_attention(self, x, q, q_latent, c_kv, k_rope, seq)
        elif self.indexer is None or seq.dsa_dense:
            # dsa_dense: the top-k would be every causal key, and the absorbed sparse form equals the dense one.
            out = self.dense_attention(q, c_kv, k_rope, seq)
        else:
            latent = torch.cat([c_kv, k_rope], dim=-1).view(-1, self.kv_lora_rank + self.rope)  # all rows' keys
            out = self.sparse_attention(self.latent_queries(q), latent, self.indexer(x, q_latent, seq), B, S)[0]
        out = out.reshape(B, S, n * self.v_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def dense_attention(self, q, c_kv, k_rope, seq: SequenceInfo) -> torch.Tensor:
        B, _, n, _ = q.shape
        Sk = c_kv.shape[1]  # the whole row's keys under context parallelism, else the queries' own
        k_nope, v = self.kv_b_proj(c_kv).view(B, Sk, n, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, Sk, n, self.rope)], dim=-1)
        return ops.causal_attention(q, k, v, scale=self.scale, seg_start=seq.seg_start, q_positions=seq.positions,
                                    cu_seqlens=seq.cu_seqlens)

    def latent_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B,S,n,qk]`` -> ``[T,n,kv_lora+rope]`` in the absorbed form: q_nope . (W_k c) == (W_k^T q_nope) . c,
        so queries move into the latent space instead of keys leaving it."""
        n = self.n_heads
        w_k = linear_weight(self.kv_b_proj).view(n, self.nope + self.v_dim, self.kv_lora_rank)[:, : self.nope]
        q_nope, q_rope = q.reshape(-1, n, self.qk_dim).split([self.nope, self.rope], dim=-1)
        return torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_k), q_rope], dim=-1)

    def sparse_attention(self, q_latent: torch.Tensor, kv_latent: torch.Tensor, indices: torch.Tensor, B: int,
                         S: int, distill: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the absorbed queries to the selected rows of ``kv_latent [rows' keys, kv_lora+rope]``:
        ``out [B,S,n,v]`` and the per-head LSE ``[T,n]``. ``distill`` = (the indexer's scores at ``indices``,
        per-query KL weights): the backward also gives the scores their KL's gradient (indexer training)."""
        n = self.n_heads
        w_v = linear_weight(self.kv_b_proj).view(n, self.nope + self.v_dim, self.kv_lora_rank)[:, self.nope :]
        if distill is None:
            out_latent, lse = ops.sparse_mla(q_latent, kv_latent, indices, scale=self.scale, d_v=self.kv_lora_rank)
        else:
            out_latent, lse = ops.sparse_mla_distilled(q_latent, kv_latent, indices, *distill, scale=self.scale,
                                                       d_v=self.kv_lora_rank)
        return torch.einsum("thc,hvc->thv", out_latent, w_v).view(B, S, n, self.v_dim), lse

    def init_weights(self) -> None:
        linears = [self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj]
        linears += [self.q_proj] if hasattr(self, "q_proj") else [self.q_a_proj, self.q_b_proj]
        linears += [self.g_proj] if self.g_proj is not None else []
        for linear in linears:
            init_linear(linear, self.init_std)
        for norm in (getattr(self, "q_a_layernorm", None), self.kv_a_layernorm):
            if norm is not None:
                norm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()
