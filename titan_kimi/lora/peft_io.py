"""Adapters on their own, in the PEFT layout: ``adapter_model.safetensors`` + ``adapter_config.json``.

Tensor names are the public HF module paths (spec §9) under PEFT's ``base_model.model.`` prefix, e.g.
``base_model.model.language_model.model.layers.3.self_attn.kv_b_proj.lora_A.weight``. They come from the same
key plans as the checkpoint (``titan_kimi.checkpoint.hf_keys``), read through the adapter:

- a module whose weight is one HF tensor saves its A and B as they are;
- our fused ``[gate | up]`` projection, which is two HF tensors stacked by rows, saves each HF module its rows of
  B with the shared A (exactly the fused adapter; loading needs the two A's to be equal);
- the stacked routed experts save per-expert ``experts.{e}.w1|w3|w2`` pairs (``w1``/``w3`` split B like
  gate/up).

Saving gathers sharded (DTensor) factors one at a time on every rank and writes from rank 0; loading copies
each rank's own shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint.dcp_states import global_rank
from titan_kimi.checkpoint.destinations import canonical_fqn, model_destinations
from titan_kimi.checkpoint.hf_keys import plan_key
from titan_kimi.lora.modules import LoRAGroupedExperts, adapter_modules, is_adapter_parameter

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


def adapter_config(model: nn.Module, targets: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    modules = adapter_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters")
    first = next(iter(modules.values()))
    hf_modules = sorted({p.key.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
                         for p in adapter_pieces(model)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.lora_rank,
        "lora_alpha": first.lora_alpha,
        "lora_dropout": float(getattr(first.lora_dropout, "p", 0.0)),
        "target_modules": hf_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": "",
        "titan_kimi_target_modules": list(targets),
    }


def save_adapters(model: nn.Module, path: str | Path, *, targets: list[str] | tuple[str, ...] = ()) -> Path:
    """Write the adapters of ``model`` to the folder ``path`` (every rank calls; rank 0 writes)."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {canonical_fqn(k): v for k, v in model.state_dict().items() if is_adapter_parameter(canonical_fqn(k))}
    pieces = adapter_pieces(model)
    tensors: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for piece in pieces:
        if piece.fqn not in full:
            value = state[piece.fqn]
            full[piece.fqn] = value.full_tensor() if isinstance(value, DTensor) else value
        tensors[piece.key] = _slice(full[piece.fqn], piece).detach().to("cpu").contiguous().clone()
    config = adapter_config(model, targets)
    if global_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def load_adapters(model: nn.Module, path: str | Path) -> list[str]:
    """Copy saved adapters into ``model``'s adapter factors, by name; every factor must be in the file and every
    tensor of the file must belong to one. Returns the factors filled."""
    from safetensors import safe_open

    path = Path(path)
    file = path / ADAPTER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no {ADAPTER_FILE} at {str(path)!r}")
    config_file = file.parent / ADAPTER_CONFIG
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        modules = adapter_modules(model)
        rank = next(iter(modules.values())).lora_rank if modules else None
        if config.get("r") != rank or config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{config_file}: a {config.get('peft_type')} adapter of rank {config.get('r')}, but "
                             f"the model's adapters have rank {rank}; set lora.rank to match")
    pieces = adapter_pieces(model)
    destinations = {d.fqn: d for d in model_destinations(model) if is_adapter_parameter(d.fqn)}
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        wanted = {p.key for p in pieces}
        missing, unexpected = sorted(wanted - keys), sorted(keys - wanted)
        if missing or unexpected:
            raise ValueError(f"{file}: adapters do not match the model: {len(missing)} missing "
                             f"({missing[:3]}), {len(unexpected)} unexpected ({unexpected[:3]})")
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
