"""Initial weights for a run (``checkpoint.initial_load_path``): an HF safetensors folder or a DCP step folder."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_kimi.checkpoint.dcp_states import ModelState
from titan_kimi.checkpoint.hf_index import INDEX_FILE
from titan_kimi.checkpoint.hf_load import load_hf_checkpoint
from titan_kimi.checkpoint.manager import quiet_single_process


def checkpoint_format(path: str | Path) -> str:
    """``"dcp"`` (a folder with DCP ``.metadata``) or ``"hf"`` (safetensors shards); ValueError otherwise."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return "dcp"
    if (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")):
        return "hf"
    steps = sorted(p.name for p in path.glob("step-*") if (p / ".metadata").is_file()) if path.is_dir() else []
    hint = f"; it holds DCP steps {steps}: pass one of them" if steps else ""
    raise ValueError(
        f"{str(path)!r} is neither a DCP checkpoint folder (with .metadata) nor an HF folder (*.safetensors){hint}"
    )


def load_model_weights(
    model: nn.Module, path: str | Path, *, expert_range: tuple[int, int] | None = None, strict: bool = True
) -> str:
    """Fill ``model`` (whole, a stage or a shard) from ``path``; returns the format read (``"hf"`` or ``"dcp"``).

    A DCP checkpoint is read for its ``model`` entry only (a full training checkpoint or a converted one).
    """
    fmt = checkpoint_format(path)
    if fmt == "hf":
        load_hf_checkpoint(model, path, expert_range=expert_range, strict=strict)
    else:
        if expert_range is not None:
            raise ValueError(
                "expert_range applies to HF loads; a DCP load reshards DTensor experts by their placements"
            )
        with quiet_single_process():
            dcp.load({"model": ModelState(model)}, checkpoint_id=str(path))
    return fmt
