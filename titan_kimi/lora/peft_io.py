"""Adapters on their own, in the PEFT layout: ``adapter_model.safetensors`` + ``adapter_config.json``.

Tensor names are the public HF module paths (spec §9) under PEFT's ``base_model.model.`` prefix, e.g.
``base_model.model.language_model.model.layers.3.self_attn.kv_b_proj.lora_A.weight``. They come from the same
key plans as the checkpoint (``titan_kimi.models.kimi_k3.state_dict_adapter``), read through the adapter:

- a module whose weight is one HF tensor saves its A and B as they are;
- our fused ``[gate | up]`` projection, which is two HF tensors stacked by rows, saves each HF module its rows of
  B with the shared A (exactly the fused adapter; loading needs the two A's to be equal);
- the stacked routed experts save per-expert ``experts.{e}.w1|w3|w2`` pairs (``w1``/``w3`` split B like
  gate/up).

Saving gathers sharded (DTensor) factors one at a time on every rank and writes from rank 0; loading copies
each rank's own shard. Under pipeline parallelism a rank holds some stages (model parts): saving gathers every
stage's tensors over the pipeline group onto rank 0, which writes the one file set a single process would;
loading fills each part's own factors, and the file must match the union of every stage's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.dcp_states import global_rank
from titan_kimi.checkpoint.destinations import canonical_fqn, model_destinations
from titan_kimi.lora.modules import LoRAGroupedExperts, adapter_modules, is_adapter_parameter
from titan_kimi.models.kimi_k3.state_dict_adapter import plan_key

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class AdapterPiece:
    """Rows ``rows`` of our factor ``fqn`` (indexed by ``expert`` first for stacked experts) are the HF tensor
    ``key``."""

    fqn: str
    key: str
    expert: int | None
    rows: slice


def _pieces(module_name: str, weight_fqn: str, shape: tuple[int, ...], a_fqn: str, b_fqn: str,
            stacked: bool) -> list[AdapterPiece]:
    out = []
    for piece in plan_key(weight_fqn, shape).pieces:
        base = PEFT_PREFIX + piece.source.key.removesuffix(".weight")
        row_dim = 1 if stacked else 0
        if any(piece.offset[row_dim + 1:]) or piece.box_shape[row_dim + 1] != shape[row_dim + 1]:
            raise ValueError(f"{module_name}: an HF piece of {weight_fqn} splits its input columns; "
                             f"LoRA's A cannot be split that way")
        expert = piece.offset[0] if stacked else None
        rows = slice(piece.offset[row_dim], piece.offset[row_dim] + piece.box_shape[row_dim])
        out.append(AdapterPiece(a_fqn, base + ".lora_A.weight", expert, slice(None)))
        out.append(AdapterPiece(b_fqn, base + ".lora_B.weight", expert, rows))
    return out


def adapter_pieces(model: nn.Module) -> list[AdapterPiece]:
    """Every saved tensor of the model's adapters, in model order (canonical names, wrappers stripped)."""
    out: list[AdapterPiece] = []
    for name, module in adapter_modules(model).items():
        name = canonical_fqn(name)
        if isinstance(module, LoRAGroupedExperts):
            for w in ("w13", "w2"):
                shape = tuple(getattr(module, w).shape)
                out += _pieces(name, f"{name}.{w}", shape, f"{name}.lora_A_{w}", f"{name}.lora_B_{w}", True)
        else:
            out += _pieces(name, f"{name}.weight", tuple(module.weight.shape), f"{name}.lora_A.weight",
                           f"{name}.lora_B.weight", False)
    return out


def _slice(tensor: torch.Tensor, piece: AdapterPiece) -> torch.Tensor:
    return (tensor[piece.expert] if piece.expert is not None else tensor)[piece.rows]


def _parts(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _pipelined(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@dataclass(frozen=True)
class _AdapterSummary:
    """What ``adapter_config`` reads from a rank's adapters (None: the rank's parts have none)."""

    rank: int | None
    alpha: float | None
    dropout: float
    hf_modules: frozenset[str]


def _summary(parts: list[nn.Module]) -> _AdapterSummary:
    modules = [m for part in parts for m in adapter_modules(part).values()]
    names = {p.key.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
             for part in parts for p in adapter_pieces(part)}
    if not modules:
        return _AdapterSummary(None, None, 0.0, frozenset())
    first = modules[0]
    return _AdapterSummary(first.lora_rank, first.lora_alpha, float(getattr(first.lora_dropout, "p", 0.0)),
                           frozenset(names))


def _config(summaries: list[_AdapterSummary], targets: list[str] | tuple[str, ...]) -> dict[str, Any]:
    present = [s for s in summaries if s.rank is not None]
    if not present:
        raise ValueError("the model has no LoRA adapters")
    first = present[0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout,
        "target_modules": sorted(set().union(*(s.hf_modules for s in present))),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": "",
        "titan_kimi_target_modules": list(targets),
    }


def adapter_config(model: nn.Module | Sequence[nn.Module], targets: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of the adapters of ``model`` (one module, or this rank's parts)."""
    return _config([_summary(_parts(model))], targets)


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{HF key: CPU tensor}`` of the adapters of one model part, sharded factors gathered (every rank of the
    part's meshes calls, in the same order)."""
    state = {canonical_fqn(k): v for k, v in model.state_dict().items() if is_adapter_parameter(canonical_fqn(k))}
    tensors: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for piece in adapter_pieces(model):
        if piece.fqn not in full:
            value = state[piece.fqn]
            full[piece.fqn] = value.full_tensor() if isinstance(value, DTensor) else value
        tensors[piece.key] = _slice(full[piece.fqn], piece).detach().to("cpu").contiguous().clone()
    return tensors


def save_adapters(model: nn.Module | Sequence[nn.Module], path: str | Path, *,
                  targets: list[str] | tuple[str, ...] = (), group: dist.ProcessGroup | None = None) -> Path:
    """Write the adapters of ``model`` (one module, or this rank's pipeline stages with ``group`` the pipeline
    group) to the folder ``path``: every rank calls, rank 0 writes the whole model's one file set."""
    from safetensors.torch import save_file

    path = Path(path)
    parts = _parts(model)
    tensors: dict[str, torch.Tensor] = {}
    for part in parts:
        tensors.update(adapter_tensors(part))
    summaries = [_summary(parts)]
    if _pipelined(group):  # every stage's tensors onto the group's first rank (global rank 0's group)
        gathered: list | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
        dist.gather_object((tensors, summaries[0]), gathered, group=group, group_dst=0)
        if gathered is not None:
            tensors = {k: v for stage_tensors, _ in gathered for k, v in stage_tensors.items()}
            summaries = [summary for _, summary in gathered]
    if global_rank() == 0:
        config = _config(summaries, targets)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def load_adapters(model: nn.Module | Sequence[nn.Module], path: str | Path, *,
                  group: dist.ProcessGroup | None = None) -> list[str]:
    """Copy saved adapters into the adapter factors of ``model`` (one module, or this rank's pipeline stages with
    ``group`` the pipeline group), by name; every factor must be in the file and every tensor of the file must
    belong to one (of some stage). Returns the factors filled."""
    from safetensors import safe_open

    path = Path(path)
    file = path / ADAPTER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no {ADAPTER_FILE} at {str(path)!r}")
    parts = _parts(model)
    config_file = file.parent / ADAPTER_CONFIG
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        modules = [m for part in parts for m in adapter_modules(part).values()]
        rank = modules[0].lora_rank if modules else None
        if modules and (config.get("r") != rank or config.get("peft_type", "LORA") != "LORA"):
            raise ValueError(f"{config_file}: a {config.get('peft_type')} adapter of rank {config.get('r')}, but "
                             f"the model's adapters have rank {rank}; set lora.rank to match")
    pieces = {id(part): adapter_pieces(part) for part in parts}
    wanted = {p.key for part_pieces in pieces.values() for p in part_pieces}
    everywhere = set(wanted)
    if _pipelined(group):  # a key of the file may belong to another rank's stage
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, wanted, group=group)
        everywhere = set().union(*gathered)
    filled: list[str] = []
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        missing, unexpected = sorted(wanted - keys), sorted(keys - everywhere)
        if missing or unexpected:
            raise ValueError(f"{file}: adapters do not match the model: {len(missing)} missing "
                             f"({missing[:3]}), {len(unexpected)} unexpected ({unexpected[:3]})")
        for part in parts:
            filled += _load_part(part, pieces[id(part)], f, file)
    return filled


def _load_part(model: nn.Module, pieces: list[AdapterPiece], f, file: Path) -> list[str]:
    """Fill one part's factors from the open safetensors file ``f``."""
    destinations = {d.fqn: d for d in model_destinations(model) if is_adapter_parameter(d.fqn)}
    full: dict[str, torch.Tensor] = {}
    filled_a: set[tuple[str, int | None]] = set()
    for piece in pieces:
        dest = destinations[piece.fqn]
        if piece.fqn not in full:
            full[piece.fqn] = torch.zeros(dest.global_shape, dtype=torch.float32)
        value = f.get_tensor(piece.key)
        target = _slice(full[piece.fqn], piece)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{file}: {piece.key} has shape {list(value.shape)}, the model needs "
                             f"{list(target.shape)}")
        if piece.key.endswith(".lora_A.weight"):
            if (piece.fqn, piece.expert) in filled_a and not torch.equal(target, value.float()):
                raise ValueError(f"{file}: {piece.key} differs from the A of the other half of its fused "
                                 f"projection; titan_kimi fuses gate/up (w1/w3) and needs one shared A")
            filled_a.add((piece.fqn, piece.expert))
        target.copy_(value.float())
    with torch.no_grad():
        for fqn, value in full.items():
            dest = destinations[fqn]
            box = tuple(slice(o, o + s) for o, s in zip(dest.offset, dest.local_shape))
            dest.local.copy_(value[box].to(dest.local.dtype))
    return list(full)
