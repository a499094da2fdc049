"""One expert-parallel rank's experts without the all-to-alls: the dispatch training runs (torchtitan's
``ExpertParallel`` through ``titan_kimi.parallel.expert_parallel``, or the hierarchical dispatch of
``titan_kimi.parallel.expert_node_dispatch``) with every exchange replaced by local rows.

What stays as training runs it: the MoE forward's routing and sort (padding tokens' choices left out), the
local experts' weights (``num_experts / ep`` of them) in ``ExpertShardGroupedExperts``, the permutation
(``expert_permutation``: group the received rows by local expert, pad each group to the GEMM alignment, and
back), one host sync per dispatch level, and under the hierarchical dispatch its own local work (the (token,
node) pairs, the relay's sort of their choices and its weighted sums, the token's sum over its nodes). What
changes: the rows that arrive at the experts are ``load.rows`` rows gathered from the rows this rank would send
(the all-to-all's output has that size; its content does not change the compute), and the combine hands back
as many rows as were sent by another gather; under the hierarchical dispatch a relay receives the pairs this
rank sends (what it receives under a balanced load). The gathers stand for the all-to-alls, whose time the
step-time model adds from its bandwidths.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from titan_kimi.config.parallelism import node_groups_problem
from titan_kimi.models.kimi_k3.moe import LatentMoE
from titan_kimi.parallel.expert_node_dispatch import NodeDispatchExperts, node_dispatch_class
from titan_kimi.parallel.expert_parallel import (_permutation_on_any_device, expert_shard_class, moe_blocks,
                                                routed_count)
from titan_kimi.parallel.expert_permutation import permute, unpermute
from titan_kimi.parallel.host_readback import HostReadback
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad


def cycle_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of ``x`` taken cyclically, by slicing and repeating: the stand-in for an all-to-all costs
    a copy at most, and its backward a sum over the repeats (an indexed gather's backward is a sort-based or
    atomic scatter, slower than the all-to-all's own copy)."""
    n = x.shape[0]
    repeats = -(-count // n)
    return (x if repeats == 1 else x.repeat(repeats, *([1] * (x.dim() - 1))))[:count]


class LocalDispatch:
    """One MoE layer's exchange with its local experts, for one dispatch level: ``exchange_splits`` /
    ``send_rows`` / ``_token_combine``, the halves of ``routed_rows_style``'s dispatch and combine (the
    hierarchical dispatch's node level calls them), and ``dispatch`` / ``combine``, the forward pre-hook and hook
    of the flat dispatch's ``moe.experts``. It holds that layer's permutation between the two. ``sources``: the
    ranks the experts' rows come from (the EP group flat, a node's ranks at the node level)."""

    def __init__(self, load: ExpertLoad, sources: int = 0) -> None:
        self.ep, self.local = load.counts.shape
        self.sources = sources or self.ep
        if self.ep % self.sources:
            raise ValueError(f"rows from {self.sources} source ranks: the load's {self.ep} ranks do not split "
                             "into them")
        self.load = load
        self._flat_counts: torch.Tensor | None = None
        self._state: tuple | None = None

    def set_load(self, load: ExpertLoad) -> None:
        if load.counts.shape != (self.ep, self.local):
            raise ValueError(f"a load over {tuple(load.counts.shape)} (ranks, local experts); the layer has "
                             f"{(self.ep, self.local)}")
        self.load, self._flat_counts = load, None

    def _counts(self, device: torch.device) -> torch.Tensor:
        """The load's rows per (source rank, local expert), its source ranks merged into ``sources`` groups."""
        if self._flat_counts is None or self._flat_counts.device != device:
            counts = self.load.counts.view(self.sources, self.ep // self.sources, self.local).sum(1)
            self._flat_counts = counts.reshape(-1).to(device)
        return self._flat_counts

    def start_splits(self, counts: torch.Tensor, mesh=None) -> HostReadback:
        """The rows this rank sends (the sum of ``counts``), its copy to the host queued: stands for training's
        count exchange."""
        return HostReadback(counts.sum())

    def finish_splits(self, pending: HostReadback) -> int:
        """The host sync that stands for training's one per level, for its splits."""
        return int(pending.get())

    def exchange_splits(self, counts: torch.Tensor, mesh=None) -> int:
        return self.finish_splits(self.start_splits(counts, mesh))

    def send_rows(self, rows: torch.Tensor, mesh=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` sent; ``load.rows`` arrive, grouped by local expert and aligned: (rows, rows per expert)."""
        arrived = cycle_rows(rows, self.load.rows)
        shape, permuted, indices, counts = permute(arrived, self._counts(rows.device), self.sources, self.local)
        self._state = (shape, indices, rows.shape[0])
        return permuted, counts

    def _token_combine(self, module: nn.Module, output: torch.Tensor, mesh=None) -> torch.Tensor:
        """The experts' ``output`` back in the arrived order, then as many rows as were sent."""
        shape, indices, n = self._state
        self._state = None
        return cycle_rows(unpermute(output, shape, indices), n)

    def dispatch(self, module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        # this rank's rows sorted by global expert, then its unrouted slots (padding tokens' choices), which the
        # dispatch leaves out
        routed, counts = inputs
        return self.send_rows(routed[:routed_count(self, module, counts, None)])

    def combine(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return self._token_combine(module, output)


class LocalNodeDispatchExperts(NodeDispatchExperts):
    """The hierarchical dispatch on one rank with its exchanges across nodes replaced by local moves: the relay
    receives the pairs this rank sends (each pair's experts on one node, their ids local to it), its node level
    is a ``LocalDispatch`` over the node's ranks (``node_style``)."""

    nodes: int

    def _node_count(self) -> int:
        return self.nodes

    def _start_pair_splits(self, send: torch.Tensor) -> HostReadback:
        return HostReadback(send)

    def _finish_pair_splits(self, pending: HostReadback) -> tuple[list[int], list[int]]:
        splits = pending.get()  # the across level's host sync
        return splits, list(splits)

    def _to_relays(self, rows, weights, experts, recv_splits, send_splits, beside):
        return rows, weights, beside(experts)

    def _from_relays(self, sums: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        return sums


@functools.cache
def local_node_class(cls: type) -> type:
    """``LocalNodeDispatchExperts`` over ``node_dispatch_class(cls)`` (LoRA's adapted experts keep their
    ``run``)."""
    return type(f"Local{node_dispatch_class(cls).__name__}", (LocalNodeDispatchExperts, node_dispatch_class(cls)), {})


def localize_experts(model: nn.Module, load: ExpertLoad, node_size: int = 0) -> list[LocalDispatch]:
    """Give every MoE layer of ``model`` the ``load.counts.shape[1]`` local experts of one EP rank (the first
    ones; free on the meta device, before materialising) and the local stand-in of its dispatch: the flat one,
    or with ``node_size`` > 0 the hierarchical one over nodes of that many ranks. Returns the exchanges (one per
    layer), whose load ``LocalDispatch.set_load`` changes."""
    _permutation_on_any_device()
    exchanges = []
    ep, local = load.counts.shape
    if node_size:
        problem = node_groups_problem(ep, node_size)
        if problem:
            raise ValueError(f"the hierarchical dispatch over nodes of {node_size} ranks: {problem}")
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
        if node_size:
            # the hierarchical dispatch reads the global expert count (its node-local ids), as in training
            exchange = LocalDispatch(load, sources=node_size)
            experts.__class__ = local_node_class(type(experts))
            experts.nodes, experts.node, experts.node_style = ep // node_size, None, exchange
        else:
            exchange = LocalDispatch(load)
            experts.num_experts = local
            experts.__class__ = expert_shard_class(type(experts))
            experts.register_forward_pre_hook(exchange.dispatch)
            experts.register_forward_hook(exchange.combine)
            experts.count_exchange = (exchange, None)  # its start_route starts the count read early, as in training
        exchanges.append(exchange)
    return exchanges
