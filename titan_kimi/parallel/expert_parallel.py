"""Expert parallelism: torchtitan's ``ExpertParallel`` on every ``moe.experts``.

Each EP rank keeps ``E / ep`` experts (weights ``Shard(0)`` on the ep mesh); tokens go to their experts' ranks
by an all-to-all in the latent width and come back by another (torchtitan's dispatch and combine), and the local
experts run one grouped GEMM over their rows. Two things the model's local forward does not know about live
here: the weights are DTensors whose local shards the GEMM takes, and the rows arrive already grouped and
aligned by the permutation (``expert_permutation``, in place of torchtitan's; so the model's own CUDA alignment
copy is skipped).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_kimi.models.kimi_k3.moe import GroupedExperts
from titan_kimi.parallel.host_readback import HostReadback


class ExpertShardGroupedExperts(GroupedExperts):
    """``GroupedExperts`` on an expert-parallel rank: the same computation on the local expert shards.

    ``count_exchange`` (set by ``shard_flat``): the dispatch's style and mesh, whose count exchange
    ``start_route`` starts early; the style's forward pre-hook on this module then reads its splits from
    ``started_splits`` (set for the length of ``route``)."""

    count_exchange: tuple[object, DeviceMesh | None] | None = None
    started_splits: HostReadback | None = None

    def start_route(self, indices: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> HostReadback | None:
        if self.count_exchange is None:
            return None
        style, mesh = self.count_exchange
        return style.start_splits(num_tokens_per_expert, mesh)

    def route(self, *args, started: HostReadback | None = None, **kwargs):
        # the dispatch runs in the experts' forward pre-hook, which sees the module, not route's arguments
        self.started_splits = started
        try:
            return super().route(*args, **kwargs)
        finally:
            self.started_splits = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13, self.w2
        if isinstance(w13, DTensor):
            # Tokens per expert vary step to step, which DTensor cannot express: compute on the local shards.
            w13, w2 = w13.to_local(), w2.to_local()
        return self.run(w13, w2, x, num_tokens_per_expert)


@functools.cache
def expert_shard_class(cls: type) -> type:
    """``ExpertShardGroupedExperts`` for plain experts; for a subclass (LoRA's adapted experts, whose ``run``
    adds the low-rank terms) a class that is both."""
    if cls is GroupedExperts:
        return ExpertShardGroupedExperts
    if issubclass(cls, ExpertShardGroupedExperts):
        return cls
    return type(f"ExpertShard{cls.__name__}", (ExpertShardGroupedExperts, cls), {})


@functools.cache
def _permutation_on_any_device() -> None:
    """Two changes to torchtitan's token permutation. Its index generation calls a Triton kernel
    unconditionally, its CPU path behind ``use_cpu``: CPU tensors go there (GPU tensors keep the kernel). And
    ``ExpertParallel``'s ``_permute`` / ``_unpermute`` become the gathers of ``expert_permutation`` (the same
    rows and gradients, without the sort-based and element-wise indexing kernels)."""
    import torchtitan.distributed.expert_parallel as tt_expert_parallel
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.models.moe.kernels import generate_permute_indices

    from titan_kimi.parallel.expert_permutation import permute, unpermute

    def generate(tokens_per_expert_group, *args, **kwargs):
        kwargs.setdefault("use_cpu", not tokens_per_expert_group.is_cuda)
        return generate_permute_indices(tokens_per_expert_group, *args, **kwargs)

    moe_utils.generate_permute_indices = generate
    tt_expert_parallel._permute, tt_expert_parallel._unpermute = permute, unpermute


def set_expert_row_alignment(rows: int) -> None:
    """The EP permutation pads each local expert's received rows to a multiple of ``rows``: torchtitan's
    process-wide ``TOKEN_GROUP_ALIGN_SIZE_M``, which its index generation and ``expert_permutation`` read per call
    (8 for bf16 grouped GEMMs, 16 for FP8's)."""
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    set_token_group_alignment_size_m(rows)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for block in model.layers.values() if getattr(block, "moe_enabled", False)]


def routed_count(style, experts: nn.Module, num_tokens_per_expert: torch.Tensor, mesh: DeviceMesh | None) -> int:
    """The routed rows ``experts`` send, read by the dispatch ``style`` (``routed_rows_style``'s, or the rank
    slice's stand-in): from the splits the experts' ``start_route`` started (``started_splits``), else exchanged
    now."""
    pending = getattr(experts, "started_splits", None)
    if pending is not None:
        return style.finish_splits(pending)
    return style.exchange_splits(num_tokens_per_expert, mesh)


@functools.cache
def routed_rows_style() -> type:
    """torchtitan's ``ExpertParallel`` whose dispatch sends only the routed rows: the experts' input may end in
    unrouted slots (padding tokens' choices, past the counts' sum), which no rank computes; the combine then
    hands back the routed rows alone (``GroupedExperts.route`` appends the zero rows after the shared experts
    are queued, so the exchange stays in flight beside them). Its dispatch makes one host sync, for the splits,
    which also give the routed count; the experts' ``start_route`` starts it before the latent projection is
    queued (its pre-hook finishes it: ``routed_count``). ``exchange_splits`` and ``send_rows`` are its two halves, for a
    caller that builds the rows once the count is known (the hierarchical dispatch's node level, which also
    splits the first in two: ``start_splits`` before the work that may run through the sync, ``finish_splits``
    after)."""
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from titan_kimi.parallel.expert_permutation import permute

    class RoutedRowsExpertParallel(ExpertParallel):
        def start_splits(self, num_tokens_per_expert: torch.Tensor, device_mesh: DeviceMesh) -> HostReadback:
            """Exchange the per-expert counts and queue the all-to-all's splits' copy to the host; keep the
            counts each local expert receives from each rank. ``finish_splits`` reads them."""
            ep = device_mesh.shape[0]
            with torch.no_grad():
                received = torch.ops._c10d_functional.wait_tensor(
                    all_to_all_single(num_tokens_per_expert, None, None, group=device_mesh.get_group()))
                splits = torch.stack([num_tokens_per_expert.view(ep, -1).sum(1), received.view(ep, -1).sum(1)])
            self._received = received
            return HostReadback(splits)

        def finish_splits(self, pending: HostReadback) -> int:
            """Set the all-to-all's splits from ``start_splits``' copy (the one host sync: it waits for that copy
            alone). Returns the rows this rank sends."""
            self.input_splits, self.output_splits = pending.get()
            return sum(self.input_splits)

        def exchange_splits(self, num_tokens_per_expert: torch.Tensor, device_mesh: DeviceMesh) -> int:
            """``start_splits`` and ``finish_splits`` at once."""
            return self.finish_splits(self.start_splits(num_tokens_per_expert, device_mesh))

        def send_rows(self, rows: torch.Tensor, device_mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
            """``rows`` (as many as ``exchange_splits`` returned, sorted by expert) to their experts' ranks,
            grouped by local expert and aligned for the grouped GEMM: (rows, tokens per local expert)."""
            ep, received = device_mesh.shape[0], self._received
            self._received = None
            rows = all_to_all_single_autograd(rows, self.output_splits, self.input_splits, device_mesh.get_group())
            self.input_shape, rows, self.permuted_indices, counts = permute(rows, received, ep,
                                                                            received.shape[0] // ep)
            return rows, counts

        def _token_dispatch(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh):
            rows, num_tokens_per_expert = inputs
            routed = routed_count(self, mod, num_tokens_per_expert, device_mesh)
            return self.send_rows(rows[:routed] if routed < rows.shape[0] else rows, device_mesh)

    return RoutedRowsExpertParallel


def shard_flat(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """torchtitan's ``ExpertParallel``: the experts' shards, fed by its all-to-all hooks (the dispatch sends the
    routed rows only). The combine's exchange leaves ``forward`` unwaited, and ``GroupedExperts.route`` runs
    the MoE's shared experts before the combine reads it; the dispatch waits inside the hook, and every
    backward exchange waits at once."""
    from torch.distributed.tensor.parallel import parallelize_module

    experts.__class__ = expert_shard_class(type(experts))
    style = routed_rows_style()()
    parallelize_module(experts, ep_mesh, style)
    experts.count_exchange = (style, ep_mesh)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh,
                          shard: Callable[[nn.Module, DeviceMesh], None] = shard_flat) -> None:
    """Shard every MoE layer's routed experts over ``ep_mesh`` (call before FSDP and compile) by ``shard``:
    ``shard_flat``, or the hierarchical dispatch's (``titan_kimi.parallel.expert_node_dispatch``)."""
    _permutation_on_any_device()
    for block in moe_blocks(model):
        experts = block.moe.experts
        if experts.num_experts % ep_mesh.size():
            raise ValueError(f"{experts.num_experts} experts cannot be split over {ep_mesh.size()} EP ranks")
        frozen = [name for name, p in experts.named_parameters(recurse=False) if not p.requires_grad]
        shard(experts, ep_mesh)
        for name in frozen:  # the EP styles re-register the shards as new (trainable) Parameters
            getattr(experts, name).requires_grad_(False)
