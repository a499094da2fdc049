"""One decoder layer with the Attention-Residuals recurrence (spec §6.3)."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.attn_res import AttnResMix
from titan_kimi.models.kimi_k3.delta_attention import KimiDeltaAttention
from titan_kimi.models.kimi_k3.mla import GatedMLA
from titan_kimi.models.kimi_k3.mlp import SituMLP
from titan_kimi.models.kimi_k3.moe import LatentMoE
from titan_kimi.models.kimi_k3.norms import RMSNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo


class KimiK3Block(nn.Module):
    """``(hidden, bank) -> (hidden, bank)``.

    With AttnRes, ``hidden`` is the partial sum p of the current block and ``bank [B*S, m, H]`` holds the
    embedding and the completed block sums. A layer that starts a block first appends p to the bank.
    Without AttnRes (block size 0) it is a plain pre-norm residual layer and the bank passes through.
    """

    def __init__(self, layer_id: int, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.block_size = args.attn_res_block_size
        # A plain bool, not derived from layer_id in forward: compiled blocks then specialise on two values
        # (starts a block or not) instead of once per layer index.
        self.starts_block = bool(self.block_size) and layer_id % self.block_size == 0
        self.is_kda = args.is_kda_layer(layer_id)
        self.attention = KimiDeltaAttention(args) if self.is_kda else GatedMLA(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = LatentMoE(args)
        else:
            self.feed_forward = SituMLP(args.dim, args.inter_dim, args.situ_beta, args.situ_linear_beta, args.init_std)
        if self.block_size:
            self.attention_mix = AttnResMix(args.dim, args.norm_eps, args.init_std)
            self.ffn_mix = AttnResMix(args.dim, args.norm_eps, args.init_std)

    def _mlp(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        return self.moe(x, seq.is_real) if self.moe_enabled else self.feed_forward(x)

    def forward(self, hidden: torch.Tensor, bank: torch.Tensor, seq: SequenceInfo) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.block_size:
            hidden = hidden + self.attention(self.attention_norm(hidden), seq)
            return hidden + self._mlp(self.ffn_norm(hidden), seq), bank
        B, S, H = hidden.shape
        x = self.attention_mix(bank, hidden) if bank.shape[1] else hidden
        attn = self.attention(self.attention_norm(x), seq)
        if self.starts_block:
            bank = torch.cat([bank, hidden.reshape(B * S, 1, H)], dim=1)
            hidden = attn
        else:
            hidden = hidden + attn
        mlp_in = self.ffn_mix(bank, hidden)
        return hidden + self._mlp(self.ffn_norm(mlp_in), seq), bank

    def init_weights(self) -> None:
        self.attention.init_weights()
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        (self.moe if self.moe_enabled else self.feed_forward).init_weights()
        if self.block_size:
            self.attention_mix.init_weights()
            self.ffn_mix.init_weights()
