"""Per-rank parameter and memory estimate of a layout (the dry run prints it; built on the meta device).

Counted: this rank's shard of the parameters, their gradients and the Adam moments, plus the gathered weights
of the two largest FSDP units in flight (one computing, one prefetched). Activations only on request
(``job.estimate_activations``): measured on fake tensors by ``titan_kimi.parallel.activation_estimate``, for one
(micro)batch per stage (pipeline schedules keep several in flight on early stages). Not counted: communication
buffers, the allocator's slack.
"""

from __future__ import annotations

import torch

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.parallel.layout import ParallelLayout
from titan_kimi.training.build import build_meta_model

_BYTES = {torch.float32: 4, torch.bfloat16: 2}


def _stage_bytes(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, layer_range) -> tuple[int, float, float]:
    """(parameters on one rank, GiB of states per rank, GiB of gathered weights in flight) for one stage."""
    model = build_meta_model(args, DTYPES[cfg.model.dtype], indexer_mode=cfg.indexer.mode,
                             warmup_trains=cfg.indexer.warmup_trains,
                             layer_range=layer_range)
    keep = fp32_parameter_names(model)
    state = DTYPES[cfg.optimizer.state_dtype]
    compute = DTYPES[cfg.training.param_dtype] if cfg.training.mixed_precision else DTYPES[cfg.model.dtype]
    params = states = 0.0
    units: list[float] = []
    for name, module in model.named_children():
        if name == "layers":
            for block in module.values():
                dense = sum(p.numel() for n, p in block.named_parameters() if ".experts." not in f".{n}")
                experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
                units.append((dense + experts / layout.ep) * _BYTES[compute])
        elif module is not None:
            units.append(sum(p.numel() for p in module.parameters()) * _BYTES[compute])
    for name, p in model.named_parameters():
        share = p.numel() / layout.fsdp  # experts: over ep x efsdp = fsdp ranks; dense: over fsdp
        width = 4 if name in keep else _BYTES[p.dtype]
        params += share
        states += share * width * (2 if p.requires_grad else 1)  # weight + gradient
        if p.requires_grad:
            states += share * (4 if name in keep else _BYTES[state]) * 2  # exp_avg, exp_avg_sq
    in_flight = sum(sorted(units)[-2:]) if layout.fsdp > 1 else 0.0
    return int(params), states / 2**30, in_flight / 2**30


def _activations(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, ranges) -> tuple[float, float]:
    from titan_kimi.parallel.activation_estimate import estimate_activations

    rows = layout.microbatch_size if layout.pipeline is not None else cfg.training.local_batch_size
    ac = cfg.activation_checkpoint
    acts = scores = 0.0
    for layer_range in ranges:
        est = estimate_activations(args, rows=rows, seq_len=cfg.training.seq_len, cp=layout.cp,
                                   cp_layout=layout.cp_layout, layer_range=layer_range, ac_mode=ac.mode,
                                   ac_option=ac.selective_ac_option)
        acts, scores = acts + est["activations"], max(scores, est["indexer_scores"])
    return acts, scores


def describe_ranks(cfg, args: KimiK3ModelArgs, layout: ParallelLayout, *, activations: bool = False) -> list[str]:
    """One line per pipeline rank (all ranks of one pipeline rank hold the same shapes); with ``activations``,
    a second line with the measured activation peak and the total."""
    plan = layout.pipeline
    ranks = range(plan.pp) if plan is not None else [0]
    lines = []
    for rank in ranks:
        ranges = [plan.ranges[s] for s in plan.stages_of_rank(rank)] if plan is not None else [None]
        params = states = flight = 0.0
        for layer_range in ranges:
            p, s, f = _stage_bytes(cfg, args, layout, layer_range)
            params, states, flight = params + p, states + s, max(flight, f)
        where = f"pp rank {rank}" if plan is not None else "every rank"
        lines.append(f"{where}: {params / 1e9:.3f} B params per rank, {states:.1f} GiB params + grads + Adam "
                     f"moments, + {flight:.1f} GiB gathered weights in flight = {states + flight:.1f} GiB "
                     f"(activations not included)")
        if activations:
            acts, scores = _activations(cfg, args, layout, ranges)
            t = cfg.training
            rows = layout.microbatch_size if plan is not None else t.local_batch_size
            cp = f"cp {layout.cp} {layout.cp_layout}" if layout.cp > 1 else "cp 1"
            lines.append(
                f"{where}: activations {acts:.3g} GiB for {rows} x {t.seq_len // layout.cp} local tokens of "
                f"{t.seq_len} ({cp}, activation_checkpoint {cfg.activation_checkpoint.mode}"
                f"{', one microbatch per stage' if plan is not None else ''}) + indexer score chunk <= "
                f"{scores:.3g} GiB -> peak about {states + flight + acts + scores:.3g} GiB per rank")
    return lines
