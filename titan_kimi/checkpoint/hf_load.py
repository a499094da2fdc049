"""Load the public HF checkpoint layout into a model, a pipeline stage, an FSDP shard or an expert-parallel rank.

The model's ``state_dict()`` names what it owns; only those tensors (and, within them, only the owned boxes)
are read, shard file by shard file, each slice copied (MXFP4 experts decoded) straight into the destination.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from titan_kimi.checkpoint.destinations import model_destinations
from titan_kimi.checkpoint.hf_index import CONFIG_FILE, HFCheckpoint
from titan_kimi.checkpoint.hf_plan import MXFP4, Read, plan_load
from titan_kimi.checkpoint.model_identity import check_config_json
from titan_kimi.checkpoint.mxfp4 import GROUP, decode_mxfp4
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_key_names, is_adapter_key, is_indexer_key

Progress = Callable[[int, int], None]  # (done, total)


@dataclass
class LoadReport:
    loaded: list[str]  # model keys filled
    missing: list[str] = field(default_factory=list)  # model keys left untouched (strict=False)
    unexpected: list[str] = field(default_factory=list)  # checkpoint text keys no tensor maps to (strict=False)
    skipped: list[str] = field(default_factory=list)  # vision/projector keys the model does not own
    files_read: list[str] = field(default_factory=list)
    keys_read: list[str] = field(default_factory=list)  # HF keys whose data was read (validation included)


_EXPECTED_CACHE: dict[str, frozenset[str]] = {}


def expected_hf_keys(args: KimiK3ModelArgs) -> frozenset[str]:
    """Every HF text key a full model with ``args`` may be stored under (built on the meta device: no memory)."""
    cache_key = repr(args)
    if cache_key not in _EXPECTED_CACHE:
        from titan_kimi.models.kimi_k3.model import KimiK3Model

        with torch.device("meta"):
            full = KimiK3Model(args)
        _EXPECTED_CACHE[cache_key] = frozenset(hf_key_names({k: v.shape for k, v in full.state_dict().items()}))
    return _EXPECTED_CACHE[cache_key]


def expected_vision_keys(model: nn.Module) -> frozenset[str] | None:
    """The tower and projector keys of an image-text model (its ``vision_args``); None for a text model."""
    vision = getattr(model, "vision_args", None)
    if vision is None:
        return None
    from titan_kimi.models.kimi_k3.projector import PatchMergerMLP
    from titan_kimi.models.kimi_k3.vision import VisionTower

    with torch.device("meta"):
        tower, projector = VisionTower(vision), PatchMergerMLP(vision, model.args.dim)
    return frozenset([f"vision_tower.{k}" for k in tower.state_dict()]
                     + [f"mm_projector.{k}" for k in projector.state_dict()])


def run_read(ckpt: HFCheckpoint, read: Read, local: torch.Tensor) -> None:
    """Copy one planned read into ``local`` (the destination's local tensor, or a stand-in of the same shape)."""
    view = local[read.dst]
    if read.kind != MXFP4:
        view.copy_(ckpt.read(read.keys[0], read.src))
    else:
        rows, cols = read.src
        g0, g1 = cols.start // GROUP, -(-cols.stop // GROUP)
        packed = ckpt.read(read.keys[0], (rows, slice(g0 * GROUP // 2, g1 * GROUP // 2)))
        scale = ckpt.read(read.keys[1], (rows, slice(g0, g1)))
        if cols.start == g0 * GROUP and cols.stop == g1 * GROUP:
            decode_mxfp4(packed, scale, out=view)  # straight into the destination slice
        else:  # a column shard that cuts a scale group: decode the covering groups, keep the owned columns
            view.copy_(decode_mxfp4(packed, scale)[:, cols.start - g0 * GROUP : cols.stop - g0 * GROUP])
    _check_finite(ckpt, read, view)


def _check_finite(ckpt: HFCheckpoint, read: Read, view: torch.Tensor) -> None:
    # Caught where it enters: a NaN weight would otherwise first show as "the loss is nan" at step 1.
    finite = torch.isfinite(view)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()[0].tolist()
    what = "MXFP4 pair (a scale of 255 decodes to NaN)" if read.kind == MXFP4 else "tensor"
    raise ValueError(
        f"HF checkpoint {ckpt.path}: {what} {read.keys[0]!r} in {read.file} holds {int((~finite).sum())} "
        f"non-finite value(s), e.g. {view[tuple(bad)].item()} at index {bad} of the part read for model key "
        f"{read.fqn!r}; the checkpoint is damaged (the load stopped with the model partly filled)"
    )


def execute_reads(
    ckpt: HFCheckpoint,
    reads: Sequence[Read],
    locals_by_fqn: dict[str, torch.Tensor],
    *,
    progress: Progress | None = None,
) -> None:
    """Run planned reads, one shard file after another (only one slice in flight at a time)."""
    todo = sorted(reads, key=lambda r: r.file)
    with torch.no_grad():
        for done, read in enumerate(todo, 1):
            run_read(ckpt, read, locals_by_fqn[read.fqn])
            if progress is not None:
                progress(done, len(todo))


def load_hf_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    expert_range: tuple[int, int] | None = None,
    strict: bool = True,
    args: KimiK3ModelArgs | None = None,
    progress: Progress | None = None,
    check_config: bool = True,
    indexer_optional: bool = False,
) -> LoadReport:
    """Fill ``model``'s own tensors in place from the HF safetensors folder ``path``.

    ``model`` may be the full model (its LoRA adapters, if any, are left as they are), a pipeline stage
    (``KimiK3Model(args, layer_range=...)``), an FSDP2/DTensor sharded model, or hold only experts
    ``expert_range=(first, last)`` in its plain ``moe.experts.w13/w2``.
    Every needed key's presence, shape and dtype (and A_log's zero padding) is checked before anything is
    copied; on a problem a ValueError lists them and the model is unchanged. ``strict=False`` leaves model keys
    missing from the checkpoint untouched and ignores unexpected checkpoint keys (reported in the result).
    The folder's config.json, when it has one, must describe the same model as ``args`` (``check_config``);
    a non-finite value read stops the load naming its key and file. ``indexer_optional`` (``model.add_indexer``):
    a checkpoint without indexer weights (a K3 one) fills everything else and leaves the indexer as it is.
    """
    args = args if args is not None else getattr(model, "args", None)
    if not isinstance(args, KimiK3ModelArgs):
        raise ValueError(
            "load_hf_checkpoint needs the model args: pass args=KimiK3ModelArgs(...) or a model with .args"
        )
    destinations = [d for d in model_destinations(model, expert_range=expert_range, num_experts=args.num_experts)
                    if not is_adapter_key(d.fqn)]  # LoRA factors are not in a base checkpoint
    with HFCheckpoint(path) as ckpt:
        config = ckpt.config()
        if indexer_optional and args.has_indexer and not any(is_indexer_key(k) for k in ckpt.keys()):
            args = args.without_indexer()
            destinations = [d for d in destinations if not is_indexer_key(d.fqn)]
        if check_config and config is not None:
            check_config_json(config, args, ckpt.path / CONFIG_FILE)
        plan = plan_load(
            ckpt, destinations,
            fp32_names=fp32_parameter_names(model), expected_keys=expected_hf_keys(args), strict=strict,
            expected_vision_keys=expected_vision_keys(model),
        )
        execute_reads(ckpt, plan.reads, {d.fqn: d.local for d in destinations}, progress=progress)
        return LoadReport(
            loaded=plan.loaded,
            missing=plan.missing,
            unexpected=plan.unexpected,
            skipped=plan.skipped,
            files_read=plan.files,
            keys_read=list(dict.fromkeys(ckpt.keys_read)),  # includes A_log padding checks
        )


__all__ = ["LoadReport", "execute_reads", "expected_hf_keys", "expected_vision_keys", "load_hf_checkpoint", "run_read"]
