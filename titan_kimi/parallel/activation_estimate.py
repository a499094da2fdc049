"""Peak activation memory of one rank, measured on fake tensors (no memory, no GPU needed).

One forward and backward of the rank's model part at its real shapes, ``rows x seq_len / cp`` tokens (with the
whole sequences' keys under context parallelism), bf16 compute with the fp32-by-design parameters in fp32, the
configured activation checkpointing, the saved tensors of the CUDA kernels the job's ``[kernels]`` choices
resolve to on its GPUs (``planned_backends``, taken for the fake tensors by ``plan_as_cuda``) and the
context-parallel exchanges over a fake process group of ``cp`` ranks. torch's ``MemTracker`` classifies every
live tensor; the estimate is the most activations and temporaries live at once (after any op), not their share
at the moment parameters + gradients + activations peak, which on unsharded weights is the end of the backward.

Each MoE layer holds one EP rank's local experts (``num_experts / ep``, at least ``top_k`` so the router can
choose its k), which receive ``tokens x top_k`` rows: the average under expert parallelism; their weight
gradients' temporaries are the local experts', as on the rank.

Not counted (the estimate's line says so): workspaces inside the fused kernels (the indexer's chunked score
buffer is capped at ``SCORE_BYTES_CAP`` and reported on its own), the allocator's fragmentation, NCCL buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from lowerings.ops.indexer_topk import SCORE_BYTES_CAP
from lowerings.ops.registry import ResolvedBackends, plan_as_cuda
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import cast_model_dtype
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.sequence import build_sequence_info
from titan_kimi.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_kimi.parallel.context_parallel import ContextParallel


def _activation_peak_tracker():
    """torch's ``MemTracker`` keeping, instead of its peaks, the most bytes of activations and temporaries live
    at once (``activation_peak``). Its own peak update also walks every module tracked so far at every op: ops
    times modules, quadratic in the layers (12 full-width K3 layers 25 s, 24 layers 98 s)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class ActivationPeakTracker(MemTracker):
        activation_peak = 0

        def _update_peak_stats(self, peak_state) -> None:
            live = sum(v for snap in self._curr_mem_snap.values() for kind, v in snap.items()
                       if str(kind).rsplit(".", 1)[-1] in ("ACT", "TEMP"))
            self.activation_peak = max(self.activation_peak, live)

    return ActivationPeakTracker()


def local_expert_args(args: KimiK3ModelArgs, ep: int) -> KimiK3ModelArgs:
    """``args`` with one EP rank's ``num_experts / ep`` experts, at least ``top_k``."""
    if ep < 1 or args.num_experts % ep:
        raise ValueError(f"expert parallel degree {ep} does not divide the {args.num_experts} experts")
    return dataclasses.replace(args, num_experts=max(args.num_experts // ep, args.num_experts_per_tok))


@contextlib.contextmanager
def _fake_group(size: int):
    """A fake process group of ``size`` ranks (this process is rank 0) for the CP exchanges' shapes."""
    if size == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("the activation estimate needs its own fake process group; run it without torchrun")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def estimate_activations(args: KimiK3ModelArgs, *, kernels: ResolvedBackends, rows: int, seq_len: int, cp: int,
                         cp_layout: str, layer_range: tuple[int, int] | None = None, ac_mode: str = "none",
                         ac_option: str = "op", ep: int = 1, uncheckpointed: int = 0) -> dict[str, float]:
    """GiB at the peak of one fwd + bwd of the part ``layer_range`` on one rank of ``cp`` (and of ``ep`` for the
    experts) running the backends ``kernels`` (``planned_backends`` of the job's ``[kernels]`` section):
    ``activations`` (saved tensors and temporaries, measured) and ``indexer_scores`` (the indexer's score chunk,
    an upper bound from its cap, 0 without an indexer)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = local_expert_args(args, ep)
    local = seq_len // cp
    doc = torch.ones(rows, seq_len, dtype=torch.int32)
    with _fake_group(cp) as group:
        # the segment metadata is data dependent (nonzero): real tensors, built before the fake mode
        seq = (ContextParallel(group, cp_layout).build_sequence(rows, local, torch.device("cpu"), doc) if group
               else build_sequence_info(rows, seq_len, torch.device("cpu"), doc))
        with FakeTensorMode(allow_non_fake_inputs=True), plan_as_cuda(kernels):
            model = cast_model_dtype(KimiK3Model(args, layer_range=layer_range), torch.bfloat16)
            model.requires_grad_(True)  # MemTracker hooks every parameter; the frozen indexer gets no gradient
            apply_activation_checkpointing(model, ac_mode, ac_option, uncheckpointed)
            if model.is_first:
                inputs = (torch.zeros(rows, local, dtype=torch.long),)
            else:
                m = model.first_layer // args.attn_res_block_size if args.attn_res_block_size else 0
                inputs = (torch.zeros(rows, local, args.dim, dtype=torch.bfloat16, requires_grad=True),
                          torch.zeros(rows * local, m, args.dim, dtype=torch.bfloat16, requires_grad=True))
            tracker = _activation_peak_tracker()
            tracker.track_external(model)
            with tracker:
                out = model(*inputs, seq=seq, return_hidden=True)
                outs = (out,) if model.is_last else out
                sum(o.float().sum() for o in outs).backward()
    scores = 0.0
    if args.has_indexer:  # rows of scores over the reachable keys, capped (lowerings/ops/indexer_topk.py)
        scores = min(SCORE_BYTES_CAP, 4 * local * seq_len) / 2**30
    return {"activations": tracker.activation_peak / 2**30, "indexer_scores": scores}
