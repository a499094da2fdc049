"""One rank's share of a recipe and layout, built on one device at full width: its pipeline stages' layers (the
layer ranges of the layout's plan), one EP rank's local experts, the recipe's compute dtype, activation
checkpointing and compile (the trainer's own helpers), each stage wrapped as the schedule runs it
(``PipelineStageModule``: the last stage applies the trainer's loss).

Nothing is sharded: the dense weights are whole, as FSDP gathers them under pipeline parallelism for the whole
step; what training holds besides (the shards, their gradients and moments, the accumulated gradients' wider
dtype, layers not built) can be allocated as one buffer (``allocate_states``) so that a measured peak holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from titan_kimi.config.parallelism import planned_node_size
from titan_kimi.lora import LoRASettings
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.parallel.layout import ParallelLayout
from titan_kimi.parallel.parallelize import _ac_and_compile
from titan_kimi.parallel.pipeline import PipelineStageModule
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad
from titan_kimi.parallel.rank_slice.local_experts import LocalDispatch, localize_experts
from titan_kimi.parallel.stage_params import (RankBytes, compute_dtype, count_stage_params, holding_from_config,
                                              rank_bytes)
from titan_kimi.training.setup.build import build_meta_model, vision_args_from_config
from titan_kimi.training.loss import LinearCrossEntropyLoss


def stages_of(layout: ParallelLayout, args: KimiK3ModelArgs, pp_rank: int) -> list[tuple[int, tuple[int, int]]]:
    """``(stage index, layer range)`` of the stages pipeline rank ``pp_rank`` runs, in schedule order."""
    plan = layout.pipeline
    if plan is None:
        if pp_rank:
            raise ValueError(f"pp rank {pp_rank}: the layout has no pipeline (valid: 0)")
        return [(0, (0, args.n_layers))]
    if not 0 <= pp_rank < plan.pp:
        raise ValueError(f"pp rank {pp_rank}: valid 0..{plan.pp - 1}")
    return [(s, plan.ranges[s]) for s in plan.stages_of_rank(pp_rank)]


@dataclass
class RankSlice:
    stages: list[tuple[int, PipelineStageModule]]
    dropped: dict[int, list[int]]  # stage -> its layers not built (``max_layers``), timed per layer kind instead
    load: ExpertLoad | None
    dispatches: list[LocalDispatch]
    state_bytes: RankBytes
    num_stages: int
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def parts(self) -> list[KimiK3Model]:
        return [m.part for _, m in self.stages]

    def set_load(self, load: ExpertLoad) -> None:
        """Every MoE layer's local experts receive ``load`` from now on."""
        for d in self.dispatches:
            d.set_load(load)
        self.load = load

    def allocate_states(self, device: torch.device) -> None:
        """Allocate ``missing_bytes`` as one buffer, so that a measured peak holds what training holds."""
        self.buffers.append(torch.empty(int(self.missing_bytes), dtype=torch.uint8, device=device))

    def free_states(self) -> None:
        self.buffers.clear()

    @property
    def held_bytes(self) -> int:
        """Bytes of the built weights and (once computed) their gradients."""
        return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)
                   for part in self.parts for p in part.parameters())

    @property
    def missing_bytes(self) -> float:
        """What the rank holds for its parameters beyond the built weights and gradients: the FSDP shards,
        Adam moments, and everything of layers not built."""
        return max(0.0, self.state_bytes.total - self.held_bytes)


def _build_part(cfg, args: KimiK3ModelArgs, tokenizer, layer_range, dtype: torch.dtype, *,
                allow_block_cut: bool = False) -> KimiK3Model:
    return build_meta_model(
        args, dtype, indexer_mode=cfg.indexer.mode, warmup_trains=cfg.indexer.warmup_trains, vision=vision_args_from_config(cfg, tokenizer),
        freeze_vision_tower=cfg.model.freeze_vision_tower,
        lora=LoRASettings.from_config(cfg.lora) if cfg.lora.enable else None, layer_range=layer_range,
        allow_block_cut=allow_block_cut)


def _materialize(model: nn.Module, device: torch.device) -> None:
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    if any(getattr(m, "lora_A", None) is not None for m in model.modules()):
        from titan_kimi.lora import reset_adapters

        reset_adapters(model)


def build_head_alone(cfg, args: KimiK3ModelArgs, tokenizer, device: torch.device) -> KimiK3Model:
    """The model's last stage with only its final norm and output head on ``device`` (its layers stay on the meta
    device, never run): the head and loss measured on a rank that does not hold them."""
    part = _build_part(cfg, args, tokenizer, (args.n_layers - 1, args.n_layers), compute_dtype(cfg),
                       allow_block_cut=True)
    for module in (part.norm, part.output):
        module.to_empty(device=device)
        with torch.no_grad():
            module.init_weights()
    return part


def build_rank_slice(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, tokenizer, *, pp_rank: int,
                     load: ExpertLoad | None, device: torch.device, max_layers: int = 0) -> RankSlice:
    """The stages of ``pp_rank`` on ``device``. ``load``: the rows one EP rank's local experts receive (None
    without expert parallelism: every expert is local). ``max_layers`` > 0 builds at most that many layers per
    stage (the first ones)."""
    dtype = compute_dtype(cfg)
    stages, dropped, counted, dispatches = [], {}, [], []
    for index, layer_range in stages_of(layout, args, pp_rank):
        model = _build_part(cfg, args, tokenizer, layer_range, dtype)
        counted.append(count_stage_params(model))  # the whole stage's parameters, built or not
        first, last = layer_range
        if max_layers and last - first > max_layers:
            dropped[index] = list(range(first + max_layers, last))
            # the stage's first layers only: the part ends before the stage's end and returns (hidden, bank)
            model = _build_part(cfg, args, tokenizer, (first, first + max_layers), dtype, allow_block_cut=True)
        if layout.ep > 1:
            if load is None:
                raise ValueError(f"expert_parallel_degree {layout.ep}: the rank slice needs the expert load")
            node_size = (planned_node_size(layout.ep_node_size, cfg.step_time.gpus_per_node)
                         if layout.ep_dispatch == "hierarchical" else 0)
            dispatches += localize_experts(model, load, node_size)
        _materialize(model, device)
        _ac_and_compile(model, cfg, experts_outside=layout.ep > 1)
        stage = PipelineStageModule(model, LinearCrossEntropyLoss(cfg.training.loss_chunk_size),
                                    boundary_dtype=dtype)
        stages.append((index, stage))
    holding = holding_from_config(cfg, layout)
    bytes_ = RankBytes(0.0, 0.0, 0.0)
    for c in counted:
        b = rank_bytes(c, fsdp=layout.fsdp, efsdp=layout.efsdp, holding=holding)
        bytes_ = RankBytes(bytes_.shards + b.shards, bytes_.gathered + b.gathered,
                           bytes_.gathered_grads + b.gathered_grads)
    return RankSlice(stages, dropped, load if layout.ep > 1 else None, dispatches, bytes_,
                     layout.pipeline.num_stages if layout.pipeline is not None else 1)
