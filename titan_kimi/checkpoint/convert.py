"""Offline conversion between the HF layout and a model-only DCP checkpoint, one tensor at a time.

Neither direction builds the model in memory: shapes come from a meta-device model, and each tensor is
materialised only while it is written (HF -> DCP: when DCP asks for it; DCP -> HF: in batches of at most
one shard). The DCP side holds ``{"model": {fqn: tensor}}``, the same layout ``CheckpointManager`` saves, so a
converted folder can serve as ``checkpoint.initial_load_path`` or be exported from a training checkpoint.

An image-text model (``vision`` args) carries its tower and projector both ways, under the HF export's key names
(``state_dict_adapter.plan_key``: ``vision_tower.*`` / ``mm_projector.*``) and with its ``vision_config`` in
config.json; the DCP side records the tower's args in ``vision_args.json`` next to ``model_args.json``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from titan_kimi.checkpoint.destinations import Destination
from titan_kimi.checkpoint.hf_config import model_args_from_hf
from titan_kimi.checkpoint.hf_export import config_for, dtype_name, hf_tensors_for
from titan_kimi.checkpoint.hf_index import CONFIG_FILE, HFCheckpoint
from titan_kimi.checkpoint.hf_load import execute_reads, expected_hf_keys, expected_vision_keys
from titan_kimi.checkpoint.hf_plan import LoadPlan, Read, plan_load
from titan_kimi.checkpoint.hf_writer import DEFAULT_MAX_SHARD_BYTES, HFShardWriter
from titan_kimi.checkpoint.integrity import DamagedFile, damaged_files
from titan_kimi.checkpoint.manager import quiet_single_process
from titan_kimi.checkpoint.model_identity import (
    check_config_json,
    check_model_args,
    check_saved_keys,
    read_model_args,
    read_vision_args,
    write_model_args,
    write_vision_args,
)
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.multimodal import KimiK3VLModel
from titan_kimi.models.kimi_k3.state_dict_adapter import PASSTHROUGH_PREFIXES, vision_args_from_hf_config
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

MODEL_KEY = "model"
Progress = Callable[[int, int], None]


def meta_model(args: KimiK3ModelArgs, vision: KimiK3VisionArgs | None = None) -> KimiK3Model:
    """The whole model on the meta device: the image-text model when ``vision`` is given."""
    with torch.device("meta"):
        return KimiK3VLModel(args, vision) if vision is not None else KimiK3Model(args)


def model_tensor_specs(args: KimiK3ModelArgs, dtype: torch.dtype,
                       vision: KimiK3VisionArgs | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``{fqn: meta tensor}`` of the full model (with ``vision``'s tower and projector) in its training dtypes
    (fp32 where the model keeps fp32)."""
    model = meta_model(args, vision)
    fp32 = fp32_parameter_names(model)
    specs = {
        fqn: torch.empty(t.shape, dtype=torch.float32 if fqn in fp32 else dtype, device="meta")
        for fqn, t in model.state_dict().items()
    }
    return specs, fp32


class _HFSourcePlanner(DefaultSavePlanner):
    """Hands DCP each model tensor only when it is written, read from the HF shards at that moment."""

    def __init__(self, ckpt: HFCheckpoint, plan: LoadPlan, specs: dict[str, torch.Tensor], progress: Progress | None):
        super().__init__()
        self.ckpt, self.specs, self.progress = ckpt, specs, progress
        self.reads: dict[str, list[Read]] = defaultdict(list)
        for read in plan.reads:
            self.reads[read.fqn].append(read)
        self.done = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn.removeprefix(MODEL_KEY + ".")
        spec = self.specs[fqn]
        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        execute_reads(self.ckpt, self.reads[fqn], {fqn: tensor})
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, len(self.specs))
        return tensor


def check_vision_config(config: dict[str, Any], vision: KimiK3VisionArgs, file: Path) -> None:
    """ValueError naming every tower field where the checkpoint's ``vision_config`` and ``vision`` disagree."""
    saved = vision_args_from_hf_config(config)
    diffs = [f"{f.name}: {getattr(saved, f.name)!r} in the checkpoint, {getattr(vision, f.name)!r} given"
             for f in dataclasses.fields(KimiK3VisionArgs)
             if f.name != "init_std" and getattr(saved, f.name) != getattr(vision, f.name)]
    if diffs:
        raise ValueError(f"{file}: its vision_config describes another tower:\n  " + "\n  ".join(diffs)
                         + "\nLeave out --vision-flavor: the folder's config.json gives the tower.")


def refuse_output_in_source(source: str | Path, out: str | Path) -> None:
    """ValueError when the output is, contains or lies inside the source: ``--overwrite`` would delete what is
    being read (dcp-to-hf CKPT CKPT --overwrite used to replace the DCP steps by their export)."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
        relation = "is" if src == dst else "contains" if src.is_relative_to(dst) else "lies inside"
        raise ValueError(f"output {str(out)!r} {relation} the source {str(source)!r}; writing there would "
                         f"destroy the checkpoint being read. Choose an output outside the source")


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ValueError(f"output {str(out)!r} already exists; pass overwrite=True (--overwrite) to replace it")


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    _refuse_existing(out, overwrite)  # again: the output may have appeared during the conversion
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def hf_to_dcp(
    hf_path: str | Path,
    out_path: str | Path,
    *,
    args: KimiK3ModelArgs | None = None,
    vision: KimiK3VisionArgs | None = None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert an HF folder (MXFP4 experts dequantised) into a model-only DCP checkpoint at ``out_path``.

    ``vision``: the tower of an image-text model, whose ``vision_tower.*`` / ``mm_projector.*`` keys are then
    converted too (all of them: strict); None converts the text model and skips them."""
    out = Path(out_path)
    refuse_output_in_source(hf_path, out)
    _refuse_existing(out, overwrite)  # before the conversion's work, not only at its end
    args = args if args is not None else model_args_from_hf(hf_path)
    specs, fp32 = model_tensor_specs(args, dtype, vision)
    destinations = [Destination(fqn, t, tuple(t.shape), (0,) * t.dim()) for fqn, t in specs.items()]
    vision_keys = expected_vision_keys(meta_model(args, vision))
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with HFCheckpoint(hf_path) as ckpt:
        config = ckpt.config()
        if config is not None:
            check_config_json(config, args, ckpt.path / CONFIG_FILE,
                              remedy="Leave out --flavor / --hf-config: the folder's config.json gives the model.")
            if vision is not None and "vision_config" in config:
                check_vision_config(config, vision, ckpt.path / CONFIG_FILE)
        plan = plan_load(ckpt, destinations, fp32_names=fp32, expected_keys=expected_hf_keys(args), strict=True,
                         expected_vision_keys=vision_keys)
        try:
            with quiet_single_process():
                dcp.save(
                    {MODEL_KEY: specs},
                    storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=True, thread_count=1),
                    planner=_HFSourcePlanner(ckpt, plan, specs, progress),
                )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    write_model_args(tmp, args)
    if vision is not None:
        write_vision_args(tmp, vision)
    _replace_dir(tmp, out, overwrite)
    return out


def _read_full_metadata(dcp_path: Path) -> Metadata:
    if not (dcp_path / ".metadata").is_file():
        raise ValueError(f"{str(dcp_path)!r} is not a DCP checkpoint folder (no .metadata); pass a step-N folder")
    try:
        return FileSystemReader(str(dcp_path)).read_metadata()
    except Exception as err:  # a damaged pickle raises anything from UnpicklingError to EOFError
        raise ValueError(f"DCP metadata {dcp_path / '.metadata'} cannot be read ({type(err).__name__}: {err}); "
                         f"the checkpoint is damaged") from None


def _read_metadata(dcp_path: Path) -> dict[str, Any]:
    return _read_full_metadata(dcp_path).state_dict_metadata


def damage_outside_model(dcp_path: str | Path) -> list[DamagedFile]:
    """Files of a DCP step cut short where they hold other entries than the model (optimizer, RNG, data
    position): its weights still convert whole, but the step cannot be resumed from."""
    metadata = _read_full_metadata(Path(dcp_path))
    entries = {index.fqn.split(".", 1)[0] for index in (metadata.storage_data or {})} - {MODEL_KEY}
    return damaged_files(dcp_path, metadata, entries)


def _holds_vision(saved: dict[str, Any]) -> bool:
    return any(k.startswith(tuple(f"{MODEL_KEY}.{p}" for p in PASSTHROUGH_PREFIXES)) for k in saved)


def _dcp_model_metadata(dcp_path: Path, specs: dict[str, torch.Tensor], args: KimiK3ModelArgs,
                        vision: KimiK3VisionArgs | None) -> dict[str, TensorStorageMetadata]:
    full = _read_full_metadata(dcp_path)
    saved = full.state_dict_metadata
    damage = damaged_files(dcp_path, full, {MODEL_KEY})
    if damage:
        raise ValueError(f"DCP checkpoint {dcp_path} is damaged, its model weights cannot be converted: "
                         + "; ".join(d.describe() for d in damage))
    remedy = "Pass the --flavor / --hf-config the checkpoint was trained with (or none: model_args.json decides)."
    saved_args = read_model_args(dcp_path)
    if saved_args is not None:
        check_model_args(saved_args, args, f"DCP checkpoint {dcp_path}", remedy=remedy)
    if vision is None and _holds_vision(saved):
        raise ValueError(f"DCP checkpoint {dcp_path} holds an image-text model's tower and projector but no "
                         f"vision_args.json (saved by an older titan_kimi): pass the tower (--vision-flavor NAME, "
                         f"or --hf-config PATH/config.json with its vision_config)")
    check_saved_keys((k[len(MODEL_KEY) + 1:] for k in saved if k.startswith(MODEL_KEY + ".")), args,
                     f"DCP checkpoint {dcp_path}", remedy=remedy, vision=vision)
    found, errors = {}, []
    for fqn, spec in specs.items():
        meta = saved.get(f"{MODEL_KEY}.{fqn}")
        if not isinstance(meta, TensorStorageMetadata):
            errors.append(f"model key {fqn!r} is missing")
        elif tuple(meta.size) != tuple(spec.shape):
            errors.append(f"model key {fqn!r} has shape {list(meta.size)}, the model args give {list(spec.shape)}")
        else:
            found[fqn] = meta
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise ValueError(
            f"DCP checkpoint {dcp_path} does not match the model args (wrong --flavor/--hf-config?):\n  "
            + "\n  ".join(shown)
        )
    return found


def dcp_to_hf(
    dcp_path: str | Path,
    out_path: str | Path,
    *,
    args: KimiK3ModelArgs | None = None,
    vision: KimiK3VisionArgs | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fp32_params_dtype: torch.dtype | None = None,
    mxfp4_experts: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Export the model entry of a DCP checkpoint (training or converted) as an HF folder at ``out_path``.

    ``args`` default to the ones saved with the checkpoint (``model_args.json``); given ones must match them.
    ``vision`` (an image-text model's tower) defaults to ``vision_args.json`` saved with it; its tower and
    projector keys are written under their HF names and its ``vision_config`` into config.json.
    """
    dcp_path = Path(dcp_path)
    if args is None:
        args = read_model_args(dcp_path)
        if args is None:
            raise ValueError(f"DCP checkpoint {dcp_path} has no model_args.json (saved by an older titan_kimi): "
                             f"pass the model args (--flavor NAME or --hf-config PATH/config.json)")
    if vision is None:
        vision = read_vision_args(dcp_path)
    if (vision is None and base_config is not None and "vision_config" in base_config
            and _holds_vision(_read_metadata(dcp_path))):  # a tower saved without its args: the given config's
        vision = vision_args_from_hf_config(base_config)
    dtype_name(dtype)
    refuse_output_in_source(dcp_path, out_path)
    specs, fp32 = model_tensor_specs(args, dtype, vision)
    saved = _dcp_model_metadata(dcp_path, specs, args, vision)
    with HFShardWriter(out_path, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        batch: dict[str, torch.Tensor] = {}
        batch_bytes, done = 0, 0

        def flush() -> None:
            nonlocal batch, batch_bytes, done
            if not batch:
                return
            try:
                with quiet_single_process():
                    dcp.load({MODEL_KEY: batch}, checkpoint_id=str(dcp_path))
            except CheckpointException as err:  # a BaseException: the script's exit-2 path needs a ValueError
                raise ValueError(
                    f"reading DCP checkpoint {dcp_path} failed (damaged or missing files?):\n{err}") from None
            for fqn, tensor in batch.items():
                key_dtype = fp32_params_dtype if fp32_params_dtype is not None and fqn in fp32 else dtype
                for key, value in hf_tensors_for(fqn, tensor, dtype=key_dtype, mxfp4_experts=mxfp4_experts):
                    writer.add(key, value)
                done += 1
                if progress is not None:
                    progress(done, len(specs))
            batch, batch_bytes = {}, 0

        for fqn in specs:
            meta = saved[fqn]
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if batch and batch_bytes + nbytes > max_shard_bytes:
                flush()
            batch[fqn] = tensor
            batch_bytes += nbytes
        flush()
        config = config_for(args, vision, dtype=dtype, base_config=base_config, mxfp4_experts=mxfp4_experts)
        return writer.commit({"config.json": config})
