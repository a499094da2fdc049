"""Stable LatentMoE (spec §7.2-7.3): fp32 sigmoid router with a selection-only bias, SiTU-GLU experts in a
latent space, router weights applied after the expert down-projection, latent RMSNorm, shared expert.

Module names follow torchtitan (``moe.router``, ``moe.experts`` with ``forward(x, num_tokens_per_expert)``)
so its expert-parallel style applies to ``moe.experts`` unchanged (``titan_kimi.parallel.expert_parallel``):
this file holds the local computation only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from lowerings import ops
from lowerings.autocast import matmul_dtype
from lowerings.ops.expert_gemm import grouped_mm, row_alignment
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared, init_linear
from titan_kimi.models.kimi_k3.mlp import SituMLP
from titan_kimi.models.kimi_k3.norms import RMSNorm
from titan_kimi.models.kimi_k3.weights import linear_weight


class Router(nn.Module):
    fp32_params = ("e_score_correction_bias",)

    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.score_func, self.route_norm, self.route_scale = args.router_score_func, args.route_norm, args.route_scale
        self.num_groups, self.topk_groups = args.num_expert_groups, args.topk_groups
        self.init_std = args.init_std
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        # The checkpoint's aux-loss-free bias: it picks experts but never weights them, and it is not trained.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> routing weights ``[T, k]`` (fp32) and expert indices ``[T, k]``."""
        logits = ops.router_logits(x, linear_weight(self.gate))
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores.detach() + self.e_score_correction_bias.float()
        if self.num_groups > 1 and self.topk_groups < self.num_groups:
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.route_norm and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return {"e_score_correction_bias": InitSpec("constant", value=0.0)}  # the gate: a plain nn.Linear

    def init_weights(self) -> None:
        init_linear(self.gate, self.init_std)
        init_declared(self)


class GroupedExperts(nn.Module):
    """All routed experts of a layer as stacked weights: ``w13 [E, 2F, L]`` (gate rows then up), ``w2 [E, L, F]``.

    ``gemm_precision`` (``lowerings.ops.expert_gemm.PRECISIONS``): how the two grouped GEMMs run; set on a built
    model by ``set_routed_expert_gemm`` from ``training.routed_expert_gemm``."""

    gemm_precision = "default"

    def __init__(self, num_experts: int, dim: int, hidden: int, beta: float, beta_lin: float, init_std: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.beta, self.beta_lin, self.init_std = beta, beta_lin, init_std
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [N, L]`` sorted by expert with ``num_tokens_per_expert [E]`` rows each -> ``[N, L]``. Rows past
        the counts' sum are unrouted slots (padding tokens' choices): no expert runs on them and their output
        rows are zero (expert parallelism returns only the routed rows: ``route`` adds the zeros)."""
        if x.is_cuda:
            return _aligned_for_grouped_mm(self.run, self.w13, self.w2, x, num_tokens_per_expert,
                                           align=row_alignment(self.gemm_precision))
        routed = (torch.arange(x.shape[0], device=x.device) < num_tokens_per_expert.sum()).unsqueeze(1)
        # the grouped GEMMs leave rows outside every group unwritten, forward and backward: mask both ways
        return torch.where(routed, self.run(self.w13, self.w2, torch.where(routed, x, 0), num_tokens_per_expert), 0)

    def start_route(self, indices: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> object | None:
        """The routed path's work that needs the routing alone (``indices [T, k]``, the per-expert counts), queued
        before the latent rows are: expert parallelism starts here the exchange whose values the host must read
        for its splits, so the device runs the latent projection through that read rather than idling from it
        until the host has queued what follows. Returns what ``route`` takes as ``started``; the experts on one
        rank read nothing back (None)."""
        return None

    def route(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
              num_tokens_per_expert: torch.Tensor, dtype: torch.dtype,
              alongside: Callable[[], torch.Tensor] | None = None,
              started: object | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed path: each token's latent row ``z [T, L]`` through its experts ``indices [T, k]``, the
        outputs weighted by ``weights [T, k]`` and summed in fp32 (over the bf16-rounded expert outputs) ->
        ``[T, L]`` in ``dtype``, and ``alongside()``'s result (None without it). ``started``: ``start_route``'s
        result for the same routing.

        ``alongside`` is work independent of the routed rows (the MoE's shared experts), run where it can overlap
        the routed path's communication; the MoE's output and gradients are those of adding it after the routed
        path. Here it runs between the experts and the combine: expert parallelism wraps ``forward``, and
        torchtitan's flat dispatch returns the combine's exchange from it still in flight. The node-level
        dispatch (``titan_kimi.parallel.expert_node_dispatch``) replaces this method and runs ``alongside``
        while the rows cross nodes.

        ``indices`` of -1 are unrouted choices (padding tokens): they sort after every expert's rows, past the
        counts' sum, where the experts leave their rows zero, so those tokens' routed output is zero."""
        key = indices.view(-1)
        key = torch.where(key < 0, torch.iinfo(key.dtype).max, key)  # (global ids under expert parallelism)
        routing = ops.route_rows(torch.argsort(key, stable=True), indices.shape[1])
        slots = ops.dispatch_rows(z, routing)
        rows = self(slots, num_tokens_per_expert)
        # between the experts and the combine: under expert parallelism the combine's exchange is then in flight
        beside = alongside() if alongside is not None else None
        if rows.shape[0] < slots.shape[0]:  # expert parallelism hands back the routed rows only
            rows = torch.cat([rows, rows.new_zeros(slots.shape[0] - rows.shape[0], rows.shape[1])])
        return ops.combine_rows(rows, routing, weights, dtype), beside

    def run(self, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor,
            num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The expert MLPs on ``x`` whose rows are grouped by expert (``num_tokens_per_expert`` rows each)."""
        # grouped_mm is not autocast-aware: do what autocast does for a matmul (both operands in its dtype), else
        # follow the activations' dtype (a no-op under FSDP mixed precision). fp32 activations under autocast
        # would otherwise send the compiled step to _masked_mm, E times the work.
        dtype = matmul_dtype(x)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = grouped_mm(x, w13.transpose(-2, -1), offsets, self.gemm_precision)
        h = ops.situ_glu(h, self.beta, self.beta_lin)
        return grouped_mm(h, w2.transpose(-2, -1), offsets, self.gemm_precision).to(x.dtype)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        return {"w13": InitSpec("normal", std=self.init_std), "w2": InitSpec("normal", std=self.init_std)}

    def init_weights(self) -> None:  # this class's weights: an adapter subclass draws its factors on reset
        init_declared(self, GroupedExperts.parameter_init_specs(self))


def set_routed_expert_gemm(model: nn.Module, precision: str) -> int:
    """Every ``GroupedExperts`` of ``model`` runs its grouped GEMMs at ``precision``; returns how many."""
    row_alignment(precision)  # a ValueError for an unknown precision
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.gemm_precision = precision
    return len(experts)


def _aligned_for_grouped_mm(run, w13, w2, x, num_tokens_per_expert, align: int = row_alignment("default")):
    """Run ``run`` on a copy of ``x`` in which every expert's rows start at a multiple of ``align``.

    Static shapes and no host sync: the padded buffer has room for the worst case (``align - 1`` rows of
    padding per expert), every row's destination is computed on the device.
    """
    rows, experts = x.shape[0], num_tokens_per_expert.shape[0]
    counts = num_tokens_per_expert.to(torch.int64)
    padded = (counts + align - 1) // align * align
    ends = counts.cumsum(0)
    row = torch.arange(rows, device=x.device)
    expert = torch.searchsorted(ends, row, right=True)
    routed = expert < experts  # rows past the counts' sum are unrouted slots
    expert = expert.clamp(max=experts - 1)
    dest = (padded.cumsum(0) - padded)[expert] + row - (ends - counts)[expert]
    # Gather into the padded layout (padding rows read an appended zero row) rather than scatter: autograd's
    # index_copy keeps its whole source for backward, a gather keeps only the indices.
    # room for the worst case, a whole number of groups long: FP8's weight-gradient GEMM reads the buffer
    # transposed, whose row stride must be a multiple of 16 bytes
    room = -(-(rows + experts * (align - 1)) // align) * align
    # unrouted rows write one slot past the buffer (dropped), so its tail stays zero rows no GEMM group covers
    source = torch.full((room + 1,), rows, dtype=torch.int64, device=x.device)
    source[torch.where(routed, dest, room)] = row
    buffer = torch.cat([x, x.new_zeros(1, x.shape[1])])[source[:room]]
    out = run(w13, w2, buffer, padded)
    # the GEMMs leave rows outside every group unwritten: unrouted rows take zeros, never those rows
    return torch.where(routed.unsqueeze(1), out[torch.where(routed, dest, 0)], 0)


class LatentMoE(nn.Module):
    def __init__(self, args: KimiK3ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.num_experts = args.num_experts
        latent = args.moe_latent_dim or args.dim
        self.router = Router(args)
        self.experts = GroupedExperts(
            args.num_experts, latent, args.moe_inter_dim, args.situ_beta, args.situ_linear_beta, args.init_std
        )
        if args.moe_latent_dim:
            self.routed_expert_down_proj = nn.Linear(args.dim, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, args.dim, bias=False)
            self.routed_expert_norm = RMSNorm(latent, eps=args.norm_eps) if args.latent_moe_use_norm else None
        else:
            self.routed_expert_down_proj = self.routed_expert_up_proj = self.routed_expert_norm = None
        self.shared_experts = (
            SituMLP(args.dim, args.moe_inter_dim * args.num_shared_experts, args.situ_beta, args.situ_linear_beta,
                    args.init_std)
            if args.num_shared_experts
            else None
        )
        self.init_std = args.init_std
        # Tokens routed to each expert since the trainer last read and reset it (the load metrics: balance
        # decides expert-parallel speed). Not persistent: it is not a weight.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)

    def forward(self, x: torch.Tensor, is_real: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B,S,D]``; ``is_real [B*S]`` (None: every token): padding tokens are routed by the router but
        skip the routed experts (spec §2.3), whose output for them is zero: they carry no loss and no real
        token reads them, so only their own positions change, and no expert (or expert-parallel exchange)
        works on them."""
        B, S, D = x.shape
        x = x.view(B * S, D)
        weights, indices = self.router(x)
        if is_real is not None:
            indices = torch.where(is_real.view(-1, 1), indices, -1)  # -1: an unrouted choice
        # histc keeps the output shape static (bincount's is data dependent), which compile needs; it drops the
        # unrouted choices (-1, below its range).
        counts_f = torch.histc(indices.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts_f)
        counts = counts_f.to(torch.int64)
        # from the routing alone, before the latent projection is queued (it then runs through any host read)
        started = self.experts.start_route(indices, counts)
        z = self.routed_expert_down_proj(x) if self.routed_expert_down_proj is not None else x
        # the shared experts go to the routed path as work that may overlap its communication
        shared = (lambda: self.shared_experts(x)) if self.shared_experts is not None else None
        r, s = self.experts.route(z, weights, indices, counts, x.dtype, alongside=shared, started=started)
        if self.routed_expert_norm is not None:
            r = self.routed_expert_norm(r)
        y = self.routed_expert_up_proj(r) if self.routed_expert_up_proj is not None else r
        if s is not None:
            y = y + s
        return y.view(B, S, D)

    def init_weights(self) -> None:
        self.router.init_weights()
        self.experts.init_weights()
        for linear in (self.routed_expert_down_proj, self.routed_expert_up_proj):
            if linear is not None:
                init_linear(linear, self.init_std)
        if self.routed_expert_norm is not None:
            self.routed_expert_norm.init_weights()
        if self.shared_experts is not None:
            self.shared_experts.init_weights()
        self.tokens_per_expert.zero_()
