"""The communication model of the step-time estimate: bandwidths stated (``[step_time]`` config keys), bytes
counted from the layout and the model, one cost formula per collective.

Ranks are placed as torchtitan's mesh orders them (pp outermost, then dp_replicate, dp_shard, cp innermost):
an FSDP group (dp_shard x cp) and an EP group (``ep`` ranks inside it) are consecutive ranks, pipeline peers
are ``world / pp`` ranks apart. The experts' FSDP group (efsdp) takes one rank of each EP group: its ranks are
``ep`` apart (torchtitan's sparse mesh is pp x dp_replicate x efsdp x ep), so at ``ep >= gpus_per_node`` each of
them sits on its own node. A group of ``g`` ranks ``stride`` apart spans the nodes its ranks fall on.

- all-to-all of ``B`` bytes sent per rank (spread evenly over the group, itself included): the node-local
  part over NVLink, the rest over the rank's own NIC, whichever takes longer, plus one latency;
- all-gather / reduce-scatter of a tensor of ``S`` bytes (whole size) over ``g`` ranks: a ring moving
  ``S (g - 1) / g`` per rank, plus one latency. Inside a node at the NVLink bandwidth. Across nodes NCCL runs
  one ring per channel and spreads the channels over the NICs, so a node's ``S (g - 1) / g`` of ring traffic
  leaves through the NICs of the group's ``l`` ranks on it (the fewest any node holds): each NIC carries
  ``1 / l`` of it and the ring runs at ``min(NVLink, l x inter-node)`` (NCCL's maintainers measure ~192 GB/s of
  all-reduce bus bandwidth between DGX-A100s with 8 x 25 GB/s NICs, NVIDIA/nccl#812). The experts' FSDP group,
  one rank per node, crosses through one NIC;
- the hierarchical EP exchange (``expert_parallel_dispatch = hierarchical``): one all-to-all across nodes among
  the ranks of one local index, carrying one row per (token, node holding one of its experts), then one over
  NVLink inside the node carrying every (token, expert) row; in sequence, two latencies;
- point-to-point (pipeline): ``B`` bytes over NVLink or the NIC, plus one latency;
- the NIC's load: each collective's off-node bytes at the inter-node bandwidth (``nic_*``), summed over a step,
  bounds the step from below however the collectives overlap with compute and each other.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    nvlink_gb_per_s: float  # achieved, per GPU and direction, inside a node
    internode_gb_per_s: float  # achieved, per GPU and direction, between nodes
    gpus_per_node: int
    latency_us: float  # fixed cost of each collective or transfer

    def __post_init__(self) -> None:
        if self.nvlink_gb_per_s <= 0 or self.internode_gb_per_s <= 0 or self.gpus_per_node < 1 or self.latency_us < 0:
            raise ValueError(f"network: bandwidths must be > 0, gpus_per_node >= 1 and latency >= 0, got {self}")

    @property
    def latency(self) -> float:
        return self.latency_us * 1e-6

    def _ranks_by_node(self, group: int, stride: int) -> Counter:
        """How many ranks of a group of ``group`` ranks ``stride`` apart (consecutive at 1) each node holds."""
        if stride < 1:
            raise ValueError(f"rank stride {stride}: must be >= 1")
        return Counter(i * stride // self.gpus_per_node for i in range(group))

    def nodes(self, group: int, stride: int = 1) -> int:
        """Nodes a group of ``group`` ranks ``stride`` apart (consecutive at 1) spans."""
        return len(self._ranks_by_node(group, stride))

    def ranks_per_node(self, group: int, stride: int = 1) -> int:
        """The fewest ranks of the group that any node it spans holds."""
        return min(self._ranks_by_node(group, stride).values())

    def all_to_all(self, bytes_sent: float, group: int) -> float:
        if group <= 1 or bytes_sent <= 0:
            return 0.0
        intra = bytes_sent * (min(group, self.gpus_per_node) - 1) / group
        return max(intra / (self.nvlink_gb_per_s * 1e9), self.nic_all_to_all(bytes_sent, group)) + self.latency

    def node_all_to_all(self, across_bytes: float, nodes: int, within_bytes: float, node_size: int) -> float:
        """The hierarchical EP exchange: ``across_bytes`` sent per rank spread over ``nodes`` nodes (its own
        node's share stays), then ``within_bytes`` spread over the ``node_size`` ranks of its node."""
        if nodes <= 1 or within_bytes <= 0:
            return 0.0
        within = within_bytes * (node_size - 1) / node_size / (self.nvlink_gb_per_s * 1e9)
        return self.nic_node_all_to_all(across_bytes, nodes) + within + 2 * self.latency

    def ring(self, tensor_bytes: float, group: int, stride: int = 1) -> float:
        """An all-gather or a reduce-scatter of a whole tensor of ``tensor_bytes`` over ``group`` ranks
        ``stride`` apart."""
        if group <= 1 or tensor_bytes <= 0:
            return 0.0
        moved = tensor_bytes * (group - 1) / group
        if self.nodes(group, stride) > 1:  # the node's ring traffic over the NICs of its ranks in the group
            nics = self.ranks_per_node(group, stride) * self.internode_gb_per_s
            return moved / (min(self.nvlink_gb_per_s, nics) * 1e9) + self.latency
        return moved / (self.nvlink_gb_per_s * 1e9) + self.latency

    def point_to_point(self, nbytes: float, stride: int) -> float:
        """``nbytes`` to a rank ``stride`` ranks away."""
        if nbytes <= 0:
            return 0.0
        if self._peer_on_node(stride):
            return nbytes / (self.nvlink_gb_per_s * 1e9) + self.latency
        return self.nic_point_to_point(nbytes, stride) + self.latency

    def _peer_on_node(self, stride: int) -> bool:
        return stride < self.gpus_per_node and self.gpus_per_node % max(1, stride) == 0

    # What each collective puts on the rank's NIC (seconds at the inter-node bandwidth; nothing inside a node).
    # Every collective here sends as much as it receives, so one direction's seconds bound the NIC's load.
    def nic_all_to_all(self, bytes_sent: float, group: int) -> float:
        if group <= 1 or bytes_sent <= 0:
            return 0.0
        return bytes_sent * (group - min(group, self.gpus_per_node)) / group / (self.internode_gb_per_s * 1e9)

    def nic_node_all_to_all(self, across_bytes: float, nodes: int) -> float:
        return across_bytes * (nodes - 1) / nodes / (self.internode_gb_per_s * 1e9) if nodes > 1 else 0.0

    def nic_ring(self, tensor_bytes: float, group: int, stride: int = 1) -> float:
        if group <= 1 or tensor_bytes <= 0 or self.nodes(group, stride) == 1:
            return 0.0
        return (tensor_bytes * (group - 1) / group / self.ranks_per_node(group, stride)
                / (self.internode_gb_per_s * 1e9))

    def nic_point_to_point(self, nbytes: float, stride: int) -> float:
        if nbytes <= 0 or self._peer_on_node(stride):
            return 0.0
        return nbytes / (self.internode_gb_per_s * 1e9)

    def describe(self) -> str:
        return (f"NVLink {self.nvlink_gb_per_s:g} GB/s and inter-node {self.internode_gb_per_s:g} GB/s per GPU and "
                f"direction, {self.gpus_per_node} GPUs per node, {self.latency_us:g} us per collective")


def ep_all_to_all_bytes(tokens: float, top_k: int, latent: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends in one EP all-to-all of a MoE layer: its routed rows in the latent width
    (``tokens``: the rank's real tokens; padding tokens' choices are not sent)."""
    return float(tokens * top_k * latent * element_bytes)


def nodes_per_token(num_experts: int, top_k: int, nodes: int) -> float:
    """Expected distinct nodes holding a token's ``top_k`` distinct experts, drawn uniformly from ``num_experts``
    split evenly over ``nodes`` (K3 at EP32 over 4 nodes: 3.96)."""
    per_node = num_experts // nodes
    return nodes * (1 - math.comb(num_experts - per_node, top_k) / math.comb(num_experts, top_k))
