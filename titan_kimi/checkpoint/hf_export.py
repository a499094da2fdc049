"""Export to the public HF layout: the key plans read backwards, experts split into per-expert w1/w2/w3
(bf16 ``.weight``, or MXFP4 ``.weight_packed``/``.weight_scale``), A_log re-padded, sharded safetensors + index
+ config.json, written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.dcp_states import global_rank
from titan_kimi.checkpoint.destinations import canonical_fqn, is_expert_key, owned_state
from titan_kimi.checkpoint.hf_config import MXFP4_QUANTIZATION_CONFIG, hf_config
from titan_kimi.checkpoint.hf_writer import DEFAULT_MAX_SHARD_BYTES, HFShardWriter
from titan_kimi.checkpoint.mxfp4 import encode_mxfp4
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.init import fp32_parameter_names
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_vision_config, padded_a_log_length, plan_key
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} is not supported; valid: {list(_DTYPE_NAMES.values())}")
    return _DTYPE_NAMES[dtype]


def hf_tensors_for(
    fqn: str, tensor: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, mxfp4_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF ``(key, tensor)`` pairs of one full model tensor (views where no conversion is needed)."""
    for piece in plan_key(fqn, tensor.shape).pieces:
        source = piece.source
        box = tuple(slice(o, o + b) for o, b in zip(piece.offset, piece.box_shape))
        value = tensor[box].reshape(source.shape)
        if source.padded:
            n = source.shape[0]
            padded = torch.zeros(padded_a_log_length(n), dtype=dtype)
            padded[:n] = value
            yield source.key, padded
        elif source.expert and mxfp4_experts:
            packed, scale = encode_mxfp4(value)
            yield source.packed_key, packed
            yield source.scale_key, scale
        else:
            yield source.key, value.to(dtype)


@dataclass(frozen=True)
class ExportSettings:
    """How an HF export writes (``export_hf_checkpoint`` and ``export_hf_stages`` take these as keywords).

    All tensors in ``dtype``, the routed experts optionally MXFP4 (``mxfp4_experts``), shards of at most
    ``max_shard_bytes``. ``fp32_params_dtype`` exports the tensors the model keeps in fp32 (A_log, dt_bias, KDA
    convs, o_norm, router bias) in that dtype instead of ``dtype`` (e.g. torch.float32 to keep trained values
    exactly). ``base_config`` (e.g. the source checkpoint's config.json) keeps its non-text fields such as
    ``vision_config``. ``overwrite`` replaces an existing folder."""

    dtype: torch.dtype = torch.bfloat16
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    mxfp4_experts: bool = False
    fp32_params_dtype: torch.dtype | None = None
    base_config: dict[str, Any] | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:  # a bad dtype fails before anything is written
        dtype_name(self.dtype)
        if self.fp32_params_dtype is not None:
            dtype_name(self.fp32_params_dtype)


def write_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    writer: HFShardWriter,
    settings: ExportSettings,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Add the HF tensors of ``state`` (``model``'s tensors, or replacements such as merged LoRA weights) to
    ``writer``, one model tensor at a time; a DTensor is gathered first (a collective over its own mesh)."""
    args: KimiK3ModelArgs = model.args
    fp32_names = {canonical_fqn(n) for n in fp32_parameter_names(model)}
    wide = settings.fp32_params_dtype
    for done, (fqn, tensor) in enumerate(state.items(), 1):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # a collective: one tensor gathered at a time
        if is_expert_key(fqn) and tensor.shape[0] != args.num_experts:
            raise ValueError(
                f"{fqn} holds {tensor.shape[0]} of num_experts={args.num_experts} experts (a plain expert-parallel "
                f"shard); an HF export needs all of them: save a DCP checkpoint and convert it"
            )
        key_dtype = wide if wide is not None and fqn in fp32_names else settings.dtype
        for key, value in hf_tensors_for(fqn, tensor, dtype=key_dtype, mxfp4_experts=settings.mxfp4_experts):
            writer.add(key, value)
        if progress is not None:
            progress(done, len(state))


def export_config(model: nn.Module, settings: ExportSettings) -> dict[str, Any]:
    """The config.json of an export of ``model`` (a whole model or any stage: both carry the full args)."""
    return config_for(model.args, getattr(model, "vision_args", None), dtype=settings.dtype,
                      base_config=settings.base_config, mxfp4_experts=settings.mxfp4_experts)


def config_for(
    args: KimiK3ModelArgs,
    vision: KimiK3VisionArgs | None,
    *,
    dtype: torch.dtype,
    base_config: dict[str, Any] | None = None,
    mxfp4_experts: bool = False,
) -> dict[str, Any]:
    """config.json for text ``args`` and, for an image-text model, its tower's ``vision`` args."""
    config = hf_config(
        args,
        base=base_config,
        torch_dtype=dtype_name(dtype),
        quantization_config=MXFP4_QUANTIZATION_CONFIG if mxfp4_experts else None,
    )
    if vision is not None and "vision_config" not in config:  # an image-text model: its tower's config too
        config["vision_config"] = hf_vision_config(vision, text_hidden_size=args.dim)
        config["media_placeholder_token_id"] = vision.media_placeholder_token_id
    return config


def export_hf_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    **settings: Any,
) -> Path:
    """Write ``model`` as an HF checkpoint folder at ``path``, as ``settings`` (``ExportSettings``' fields) say.

    Host memory: one shard of copies plus one full tensor at a time. DTensor parameters are gathered one tensor
    at a time (every rank must call this); only rank 0 writes. ``tensors`` replaces ``model.state_dict()`` as
    what is written (e.g. ``titan_kimi.lora.merged_tensors(model)``: the weights with their LoRA adapters merged).
    """
    args: KimiK3ModelArgs | None = getattr(model, "args", None)
    if not isinstance(args, KimiK3ModelArgs):
        raise ValueError("export_hf_checkpoint needs a Kimi K3 model with .args (KimiK3ModelArgs)")
    if not (getattr(model, "is_first", True) and getattr(model, "is_last", True)):
        raise ValueError(
            f"the model is a pipeline stage (layers {model.first_layer}..{model.last_layer - 1}); export every "
            f"stage together with titan_kimi.checkpoint.export_hf_stages(parts, path, group=pp_group)"
        )
    options = ExportSettings(**settings)
    state = owned_state(model) if tensors is None else tensors
    distributed = dist.is_available() and dist.is_initialized()
    with HFShardWriter(path, max_shard_bytes=options.max_shard_bytes, overwrite=options.overwrite,
                       enabled=global_rank() == 0) as writer:
        if distributed:
            # Every rank checks the target as it opens its writer; without this barrier rank 0 could commit a
            # small, ungathered export before a slower rank checks, and that rank would then find the target
            # "already exists" (seen in the 4-rank parity test).
            dist.barrier()
        write_state(model, state, writer, settings=options, progress=progress)
        out = writer.commit({"config.json": export_config(model, options)})
    if distributed:
        dist.barrier()
    return out
