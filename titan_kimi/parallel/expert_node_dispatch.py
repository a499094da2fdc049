"""Expert parallelism with each token crossing to a node once (``parallelism.expert_parallel_dispatch =
hierarchical``).

torchtitan's dispatch sends a token once to every EP rank holding one of its experts: at K3's top-16 over EP32
(4 nodes of 8) a token's 16 experts sit on ~12.8 ranks of ~3.96 nodes, so ~12 copies of it cross the network
where ~3 would do (docs/step_time_model.md). Here the EP group is ``nodes x ranks_per_node`` and a MoE layer's
routed path runs in two levels:

1. across nodes: each token goes once to every node holding one of its experts, to the rank of the same local
   index there (the relay), with its experts on that node and their router weights;
2. inside the node: the relay's rows go to the experts' ranks by torchtitan's all-to-all over the node's ranks
   (the flat dispatch, permutation and grouped GEMMs of ``expert_parallel``), and come back;
3. the relay sums each token's weighted outputs of its node's experts in fp32, rounded to the compute dtype,
   and that one row per (token, node) crosses back; the token's rank sums its nodes' rows in fp32.

The MoE's shared experts run while the rows cross nodes (``overlapped_exchange``), and their backward while the
rows' gradients cross back. Each level makes one host sync, for its splits; the (token, node) pairs and the
relay's present choices take their numbers from them. Each waits for its own copy, not the whole device queue
(``host_readback``): the pairs' counts are exchanged and their copy to the host queued from the routing alone
(``start_route``), before the MoE queues its latent projection, which the device runs through the first sync;
the node level's counts are exchanged and their copy queued before the shared experts, which it runs through
the second. Forward and gradients equal the flat dispatch's up to the rounding of each node's sum (none in
fp32). The weights are sharded over the whole EP group as under the flat
dispatch; only the row movement differs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from lowerings import ops
from titan_kimi.config.parallelism import NODE_GROUPS_VALID, node_groups_problem
from titan_kimi.parallel.expert_parallel import ExpertShardGroupedExperts, expert_shard_class, routed_rows_style
from titan_kimi.parallel.host_readback import HostReadback
from titan_kimi.parallel.overlapped_exchange import all_to_all_alongside, wait_tensor


class NodeDispatchExperts(ExpertShardGroupedExperts):
    """The routed experts of one EP rank whose ``route`` moves rows node by node (set up by
    ``dispatch_by_node``: ``across`` and ``node`` meshes, ``routed_rows_style`` for the node level)."""

    across: DeviceMesh
    node: DeviceMesh
    node_style: object

    def start_route(self, indices: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, HostReadback]:
        """From the routing alone: each choice's node ``[T, k]``, which nodes each token hits ``[T, nodes]``, and
        the (token, node) pairs' count exchange with its splits' copy to the host queued (``route`` reads it)."""
        nodes = self._node_count()
        per_node = self.num_experts // nodes
        # [T, k]; an unrouted choice (-1: a padding token's) goes to the column past the last node, dropped
        node_of = torch.where(indices >= 0, indices // per_node, nodes)
        hit = torch.zeros(indices.shape[0], nodes + 1, dtype=torch.bool, device=indices.device)
        hit = hit.scatter_(1, node_of, True)[:, :nodes]
        return node_of, hit, self._start_pair_splits(hit.sum(0))

    def route(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
              num_tokens_per_expert: torch.Tensor, dtype: torch.dtype,
              alongside: Callable[[], torch.Tensor] | None = None,
              started: tuple[torch.Tensor, torch.Tensor, HostReadback] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        nodes = self._node_count()
        per_node = self.num_experts // nodes
        tokens = indices.shape[0]
        node_of, hit, pending = started if started is not None else self.start_route(indices, num_tokens_per_expert)
        send_splits, recv_splits = self._finish_pair_splits(pending)  # the level across nodes' one host sync
        # (token, node) pairs, grouped by node; their number is known from the splits: no second sync
        by_node = hit.t()
        pair_node, pair_token = torch.nonzero_static(by_node, size=sum(send_splits)).unbind(1)
        on_node = node_of[pair_token] == pair_node.unsqueeze(1)  # [P, k]: which of the token's choices are there
        experts = torch.where(on_node, indices[pair_token] - pair_node.unsqueeze(1) * per_node, -1)
        pair_weights = torch.where(on_node, weights[pair_token], 0.0)

        def beside(relay_experts: torch.Tensor):
            # queued while the rows cross nodes: the node level's counts and their exchange first, then the
            # shared experts, which keep the device busy through that level's host sync
            return self._start_node_level(relay_experts, per_node), (alongside() if alongside is not None else None)

        rows, relay_weights, (node_level, shared) = self._to_relays(
            z[pair_token], pair_weights, experts, recv_splits, send_splits, beside)
        sums = self._node_level(rows, relay_weights, node_level, dtype)
        back = self._from_relays(sums, send_splits, recv_splits)
        # each token's pairs: the (node, token) hits in the order nonzero_static listed them; a miss names no row
        listed = by_node.reshape(-1)
        pair_of = torch.where(listed, torch.cumsum(listed, 0) - 1, back.shape[0]).view(nodes, tokens).t()
        return ops.sum_present(back, pair_token, pair_of.contiguous(), dtype), shared

    # The level across nodes: its exchanges apart from the local work above (the rank-slice benchmark's stand-in,
    # titan_kimi.parallel.rank_slice.local_experts, replaces these five with local moves).
    def _node_count(self) -> int:
        return self.across.size()

    def _start_pair_splits(self, send: torch.Tensor) -> HostReadback:
        """The pairs this rank sends to each node's relay, exchanged for those its relay receives from each node;
        their copy to the host queued."""
        return HostReadback(torch.stack([send, _exchange(send, self.across.get_group())]))

    def _finish_pair_splits(self, pending: HostReadback) -> tuple[list[int], list[int]]:
        """(pairs sent to each node, pairs received from each node): the sync, on that copy alone."""
        send_splits, recv_splits = pending.get()
        return send_splits, recv_splits

    def _to_relays(self, rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, recv_splits: list[int],
                   send_splits: list[int], beside: Callable[[torch.Tensor], object]):
        """Each pair's row, router weights and node-local experts to the relays; ``beside(relay_experts)``
        queued while the rows are in flight -> (rows, weights the relay received, beside's result)."""
        group = self.across.get_group()
        # The weights and ids go first, unwaited: nothing waits before the work beside is queued, so it overlaps
        # all three exchanges (the ids' wait is the device's, in that work's order). The weights' backward waits
        # as soon as it runs; created before the rows' exchange, it runs once the rows' gradients are back, out
        # of the shared experts' backward window (all_to_all_alongside).
        relay_weights = all_to_all_single_autograd(weights, recv_splits, send_splits, group)
        pending_experts = all_to_all_single(experts, recv_splits, send_splits, group)  # ids: no gradient

        relay_rows, extra = all_to_all_alongside(rows, recv_splits, send_splits, group,
                                                 lambda: beside(wait_tensor(pending_experts)))
        return relay_rows, relay_weights, extra

    def _from_relays(self, sums: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """The relays' per-pair sums back to the pairs' tokens' ranks."""
        return all_to_all_single_autograd(sums, send_splits, recv_splits, self.across.get_group())

    def _start_node_level(self, experts: torch.Tensor, per_node: int) -> tuple[torch.Tensor, HostReadback]:
        """On the relay, from its rows' node-local ``experts [P, k]`` (-1: not on this node): the rows' routing
        (the present choices sorted first) and the node level's count exchange, its splits' copy to the host
        queued (``_node_level`` reads it)."""
        key = torch.where(experts < 0, per_node, experts).view(-1)  # absent choices sort last
        # a static-shape count: bincount's output size reads the keys' maximum back from the device (a sync)
        counts = torch.histc(key.float(), bins=per_node + 1, min=0, max=per_node + 1).to(torch.int64)
        routing = ops.route_rows(torch.argsort(key, stable=True), experts.shape[1])
        return routing, self.node_style.start_splits(counts[:per_node], self.node)

    def _node_level(self, rows: torch.Tensor, weights: torch.Tensor,
                    started: tuple[torch.Tensor, HostReadback], dtype: torch.dtype) -> torch.Tensor:
        """On the relay: ``rows [P, L]`` with their router ``weights [P, k]`` (zero where the choice is on another
        node) and ``_start_node_level``'s routing and pending splits -> each row's weighted sum over its
        experts here, ``[P, L]`` in ``dtype``."""
        routing, pending = started
        style, node = self.node_style, self.node
        present = style.finish_splits(pending)  # the node level's one host sync
        # the present choices sort first: rows for them alone, their outputs summed per row with the absent ones'
        # weights zero (the routed_combine op's kernels where they run)
        routed, local_counts = style.send_rows(ops.dispatch_present(rows, routing, present), node)
        out = style._token_combine(self, self(routed, local_counts), node)  # FSDP gathers around the call
        return ops.combine_present(out, routing, weights, dtype)


def _exchange(counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank's ``counts [n]`` (entry j for rank j of ``group``) -> what every rank sends to this one."""
    return wait_tensor(all_to_all_single(counts, None, None, group))


@functools.cache
def node_dispatch_class(cls: type) -> type:
    """``NodeDispatchExperts`` over ``expert_shard_class(cls)`` (LoRA's adapted experts keep their ``run``)."""
    shard = expert_shard_class(cls)
    if issubclass(shard, NodeDispatchExperts):
        return shard
    return type(f"NodeDispatch{cls.__name__}", (NodeDispatchExperts, shard), {})


@functools.cache
def node_meshes(ep_mesh: DeviceMesh, node_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(across, node): the EP group as ``nodes x node_size`` ranks; ``across`` holds this rank's peers of the same
    local index on the other nodes, ``node`` the EP ranks of its own node. ``node_size`` 0: LOCAL_WORLD_SIZE.
    Once per EP mesh (every pipeline stage of a rank shares it)."""
    source = "parallelism.expert_parallel_node_size"
    if not node_size:
        node_size, source = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), "the launcher's LOCAL_WORLD_SIZE"
    ep = ep_mesh.size()
    problem = node_groups_problem(ep, node_size)
    ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    if problem is None and any(r // node_size != ranks[i - i % node_size] // node_size or
                               (i % node_size == 0 and r % node_size) for i, r in enumerate(ranks)):
        problem = f"the EP group's ranks {ranks} are not whole nodes of {node_size} consecutive ranks"
    if problem:
        raise ValueError(f"parallelism.expert_parallel_dispatch = hierarchical with nodes of {node_size} ranks "
                         f"({source}): {problem}; valid: {NODE_GROUPS_VALID}, or expert_parallel_dispatch = flat")
    mesh = ep_mesh._unflatten(0, (ep // node_size, node_size), ("ep_across", "ep_node"))
    return mesh["ep_across"], mesh["ep_node"]


def dispatch_by_node(experts: nn.Module, ep_mesh: DeviceMesh, across: DeviceMesh, node: DeviceMesh) -> None:
    """``experts`` sharded over ``ep_mesh`` as torchtitan's ``ExpertParallel`` does, their routed path moving
    rows over ``across`` (this rank's peers on the other nodes) and ``node`` (its own node's EP ranks)."""
    from torch.distributed.tensor import distribute_module

    style = routed_rows_style()()
    experts.__class__ = node_dispatch_class(type(experts))
    distribute_module(experts, ep_mesh, style._partition_fn)  # the weights' shards; no input or output hooks
    experts.across, experts.node, experts.node_style = across, node, style


def shard_by_node(experts: nn.Module, ep_mesh: DeviceMesh, node_size: int = 0) -> None:
    """Shard ``experts`` over ``ep_mesh`` with the node-level routed path in place of torchtitan's all-to-all
    hooks (``apply_expert_parallel``'s ``shard``, ``node_size`` bound)."""
    dispatch_by_node(experts, ep_mesh, *node_meshes(ep_mesh, node_size))
