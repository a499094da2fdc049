"""Kimi Delta Attention layer (spec §3): projections, short convs, bounded forget gate, gated delta rule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowerings import ops
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared, init_linear
from titan_kimi.models.kimi_k3.norms import GatedRMSNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo
from titan_kimi.models.kimi_k3.short_conv import ShortConv


class DecayParams(nn.Module):
    """The fp32 forget-gate parameters, in a module of their own so FSDP2 can shard them as a separate fp32
    unit (FSDP2 needs one dtype per unit; the rest of the layer is bf16)."""

    fp32_params = ("A_log", "dt_bias")

    def __init__(self, num_heads: int, channels: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(channels))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Read through forward so FSDP2 gathers the shards; copies, because FSDP2 frees the gathered
        # parameters when this forward returns (they are tiny: H + H*d values).
        return self.A_log.clone(), self.dt_bias.clone()

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return {"A_log": InitSpec("log_uniform", low=1.0, high=16.0), "dt_bias": InitSpec("constant", value=0.0)}

    def init_weights(self) -> None:
        init_declared(self)


class KimiDeltaAttention(nn.Module):
    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.num_heads = H = args.kda_num_heads
        self.head_dim = d = args.kda_head_dim
        self.lower_bound = args.kda_gate_lower_bound
        self.init_std = args.init_std
        P = H * d
        self.q_proj = nn.Linear(args.dim, P, bias=False)
        self.k_proj = nn.Linear(args.dim, P, bias=False)
        self.v_proj = nn.Linear(args.dim, P, bias=False)
        self.q_conv1d = ShortConv(P, args.kda_conv_size)
        self.k_conv1d = ShortConv(P, args.kda_conv_size)
        self.v_conv1d = ShortConv(P, args.kda_conv_size)
        self.decay = DecayParams(H, P)
        self.f_a_proj = nn.Linear(args.dim, d, bias=False)
        self.f_b_proj = nn.Linear(d, P, bias=False)
        self.b_proj = nn.Linear(args.dim, H, bias=False)
        if args.kda_full_rank_gate:
            self.g_proj = nn.Linear(args.dim, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(args.dim, d, bias=False)
            self.g_b_proj = nn.Linear(d, P, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=args.norm_eps)
        self.o_proj = nn.Linear(P, args.dim, bias=False)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def _conv(self, conv: ShortConv, pre: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        halo = None
        if seq.exchange is not None and conv.kernel_size > 1:
            halo = seq.exchange.previous_rows(pre, conv.kernel_size - 1)  # the window reaches the previous rank
        return conv(pre, seq.pos_in_seg, halo)

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, S, _ = x.shape
        H, d = self.num_heads, self.head_dim
        q = self._conv(self.q_conv1d, self.q_proj(x), seq).view(B, S, H, d)
        k = self._conv(self.k_conv1d, self.k_proj(x), seq).view(B, S, H, d)
        v = self._conv(self.v_conv1d, self.v_proj(x), seq).view(B, S, H, d)
        u = self.f_b_proj(self.f_a_proj(x)).view(B, S, H, d)
        beta = torch.sigmoid(self.b_proj(x).float())
        A_log, dt_bias = self.decay()
        kda_args = dict(scale=1.0 / math.sqrt(d), A_log=A_log, dt_bias=dt_bias, lower_bound=self.lower_bound,
                        l2norm_qk=True)
        if seq.exchange is not None:
            # context parallelism: the recurrent state enters from the earlier pieces of each row
            o = seq.exchange.kda(q, k, v, u, beta, **kda_args)
        else:
            if seq.packed:
                # Packed documents run as one varlen sequence; the op resets the state at every cu_seqlens entry.
                q, k, v, u, beta = (t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, u, beta))
            o, _ = ops.kda(q, k, v, u, beta, cu_seqlens=seq.cu_seqlens, **kda_args)
        o = self.o_norm(o.reshape(B, S, H, d), self._output_gate(x).view(B, S, H, d))
        return self.o_proj(o.reshape(B, S, H * d))

    def init_weights(self) -> None:
        projections = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.f_b_proj, self.b_proj, self.o_proj]
        projections += [self.g_proj] if hasattr(self, "g_proj") else [self.g_a_proj, self.g_b_proj]
        for linear in projections:
            init_linear(linear, self.init_std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.init_weights()
        self.decay.init_weights()
        self.o_norm.init_weights()
