"""One expert-parallel rank's experts without the all-to-all: torchtitan's ``ExpertParallel`` dispatch and
combine (``titan_kimi.parallel.expert_parallel``) with the two all-to-alls replaced by local rows.

What stays as training runs it: the MoE forward's routing and sort (padding tokens' choices left out), the
local experts' weights (``num_experts / ep`` of them) in ``ExpertShardGroupedExperts``, the permutation
(``expert_permutation``: group the received rows by local expert, pad each group to the GEMM alignment, and
back). What changes: the rows that
arrive are ``load.rows`` rows gathered from this rank's own routed rows (the all-to-all's output has that size;
its content does not change the compute), and the combine hands back this rank's ``N`` rows by another gather.
The two gathers stand for the all-to-alls, whose time the step-time model adds from its bandwidths.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.moe import LatentMoE
from titan_kimi.parallel.expert_parallel import _permutation_on_any_device, expert_shard_class, moe_blocks
from titan_kimi.parallel.expert_permutation import permute, unpermute
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad


def cycle_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of ``x`` taken cyclically, by slicing and repeating: the stand-in for an all-to-all costs
    a copy at most, and its backward a sum over the repeats (an indexed gather's backward is a sort-based or
    atomic scatter, slower than the all-to-all's own copy)."""
    n = x.shape[0]
    repeats = -(-count // n)
    return (x if repeats == 1 else x.repeat(repeats, *([1] * (x.dim() - 1))))[:count]


class LocalDispatch:
    """Forward pre-hook and hook of one rank's ``moe.experts`` (one per MoE layer: it holds that layer's
    permutation between the two)."""

    def __init__(self, load: ExpertLoad) -> None:
        self.load = load
        self.ep, self.local = load.counts.shape
        self._flat_counts: torch.Tensor | None = None
        self._state: tuple | None = None

    def set_load(self, load: ExpertLoad) -> None:
        if load.counts.shape != (self.ep, self.local):
            raise ValueError(f"a load over {tuple(load.counts.shape)} (ranks, local experts); the layer has "
                             f"{(self.ep, self.local)}")
        self.load, self._flat_counts = load, None

    def dispatch(self, module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        # this rank's rows sorted by global expert, then its unrouted slots (padding tokens' choices), which the
        # dispatch leaves out; the host sync for the count stands for training's one sync, for its splits
        routed, counts = inputs
        routed = routed[:int(counts.sum())]
        if self._flat_counts is None or self._flat_counts.device != routed.device:
            self._flat_counts = self.load.counts.reshape(-1).to(routed.device)
        n, rows = routed.shape[0], self.load.rows
        arrived = cycle_rows(routed, rows)
        shape, permuted, indices, counts = permute(arrived, self._flat_counts, self.ep, self.local)
        self._state = (shape, indices, n)
        return permuted, counts

    def combine(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        shape, indices, n = self._state
        self._state = None
        return cycle_rows(unpermute(output, shape, indices), n)


def localize_experts(model: nn.Module, load: ExpertLoad) -> list[LocalDispatch]:
    """Give every MoE layer of ``model`` the ``load.counts.shape[1]`` local experts of one EP rank (the first
    ones; free on the meta device, before materialising) and the local dispatch. Returns the hooks (one per
    layer)."""
    _permutation_on_any_device()
    hooks = []
    ep, local = load.counts.shape
    for block in moe_blocks(model):
        moe: LatentMoE = block.moe
        experts = moe.experts
        if experts.num_experts != ep * local:
            raise ValueError(f"the load is for {ep} x {local} experts; the layer has {experts.num_experts}")
        # as apply_expert_parallel does: the same module on its local shard (EP rank 0's experts)
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.shape[0] == experts.num_experts:
                shard = p.detach()[:local].clone()
                setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        experts.num_experts = local
        experts.__class__ = expert_shard_class(type(experts))
        hook = LocalDispatch(load)
        experts.register_forward_pre_hook(hook.dispatch)
        experts.register_forward_hook(hook.combine)
        hooks.append(hook)
    return hooks
