"""The ``[indexer]`` section and ``model.add_indexer`` applied to a build: the model args' indexer and training
mode, and which weights train (the distillation itself is model code: ``models/kimi_k3/indexer_distillation``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.flavors import added_indexer_fields
from titan_kimi.models.kimi_k3.indexer import Indexer


def indexer_args(args: KimiK3ModelArgs, cfg) -> KimiK3ModelArgs:
    """``args`` with the indexer ``model.add_indexer`` adds and ``indexer.mode`` as ``index_training``; a
    ValueError names the key when the model cannot take them."""
    source = cfg.model.hf_config_path or cfg.model.flavor
    if cfg.model.add_indexer:
        if args.has_indexer:
            raise ValueError(f"model.add_indexer = true, but {source!r} already has an indexer "
                             f"({args.index_n_heads} heads); valid: false, or a K3 flavor / config.json without one")
        args = args.replace(**added_indexer_fields(None if cfg.model.hf_config_path else cfg.model.flavor))
    if cfg.indexer.mode != "frozen" and not args.has_indexer:
        raise ValueError(f"indexer.mode = {cfg.indexer.mode!r} trains the indexer, but {source!r} has none; valid: "
                         f"'frozen', a K3.1 flavor (k31_*), or model.add_indexer = true for a fresh one")
    return args.replace(index_training=cfg.indexer.mode)


def apply_indexer_trainability(model: nn.Module, mode: str, warmup_trains: str) -> None:
    """After LoRA (which freezes every base weight): the indexers train unless ``mode`` is frozen, and in a
    warm-up of the indexer alone nothing else does. Adapters never sit on the indexer (``titan_kimi.lora``)."""
    if mode == "warmup" and warmup_trains == "indexer":
        model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, Indexer):
            module.requires_grad_(mode != "frozen")


def indexer_step_inputs(batches: list[dict], cfg, layers: int, *, pp: int, cp: int, device, measure: bool,
                        as_float: bool) -> dict:
    """The model's indexer arguments for one optimizer step of host ``batches`` (this rank's micro-batches):
    ``indexer_loss_scale`` = the KL weight over the step's global count of real queries and the DSA layers (a
    device tensor, or a float for a pipeline schedule, which replicates floats to its microbatches but would
    split a tensor), and ``indexer_metrics`` (measure the recall: a logging step)."""
    from titan_kimi.training.process.distributed import host_all_reduce

    local = sum(int((b["doc_ids"] != 0).sum()) for b in batches)
    # summed on the host (no copy to the device, no wait for its queue); the ranks of one pipeline read the same
    # batch, and those of a CP group the same whole-row doc_ids
    total = host_all_reduce([float(local)])[0] / (pp * cp)
    scale = cfg.indexer.kl_weight / (max(total, 1.0) * layers)
    if not as_float:
        scale = torch.full((), scale, dtype=torch.float32, device=device)
    return dict(indexer_loss_scale=scale, indexer_metrics=measure)
