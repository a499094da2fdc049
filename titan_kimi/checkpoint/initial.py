"""Initial weights for a run (``checkpoint.initial_load_path``): an HF safetensors folder or a DCP step folder."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titan_kimi.checkpoint.dcp_states import ModelState
from titan_kimi.checkpoint.hf_index import INDEX_FILE, SINGLE_FILE
from titan_kimi.checkpoint.hf_load import load_hf_checkpoint
from titan_kimi.checkpoint.finite import check_finite_parameters
from titan_kimi.checkpoint.manager import quiet_single_process
from titan_kimi.checkpoint.model_identity import check_model_args, check_saved_keys, read_model_args
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.state_dict_adapter import is_indexer_key

MODEL_PREFIX = "model."


def checkpoint_format(path: str | Path) -> str:
    """``"dcp"`` (a folder with DCP ``.metadata``) or ``"hf"`` (an index or ``model.safetensors``); ValueError
    otherwise."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return "dcp"
    if (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file():
        return "hf"
    steps = sorted(p.name for p in path.glob("step-*") if (p / ".metadata").is_file()) if path.is_dir() else []
    hint = f"; it holds DCP steps {steps}: pass one of them" if steps else ""
    if not hint and any(path.glob("*.safetensors")):
        hint = f"; its *.safetensors files need {INDEX_FILE} (or a single file named {SINGLE_FILE})"
    raise ValueError(
        f"{str(path)!r} is neither a DCP checkpoint folder (with .metadata) nor an HF folder ({INDEX_FILE} "
        f"or {SINGLE_FILE}){hint}"
    )


def load_model_weights(
    model: nn.Module, path: str | Path, *, expert_range: tuple[int, int] | None = None, strict: bool = True,
    indexer_optional: bool = False,
) -> str:
    """Fill ``model`` (whole, a stage or a shard) from ``path``; returns the format read (``"hf"`` or ``"dcp"``).

    A DCP checkpoint is read for its ``model`` entry only (a full training checkpoint or a converted one).
    ``indexer_optional`` (``model.add_indexer``): a checkpoint without indexer weights fills everything else and
    leaves the model's indexer as initialised.
    """
    fmt = checkpoint_format(path)
    if fmt == "hf":
        load_hf_checkpoint(model, path, expert_range=expert_range, strict=strict, indexer_optional=indexer_optional)
    else:
        if expert_range is not None:
            raise ValueError(
                "expert_range applies to HF loads; a DCP load reshards DTensor experts by their placements"
            )
        fresh = indexer_optional and not _dcp_has_indexer(Path(path))
        _check_dcp_model(model, Path(path), without_indexer=fresh)
        try:
            with quiet_single_process():
                dcp.load({"model": ModelStateWithoutIndexer(model) if fresh else ModelState(model)},
                         checkpoint_id=str(path))
        except CheckpointException as err:
            raise ValueError(f"loading the model from DCP checkpoint {path} failed (damaged files?):\n{err}") from None
        check_finite_parameters(model, str(path))
    return fmt


class ModelStateWithoutIndexer(ModelState):
    """The model's state without its indexer tensors: what a K3 checkpoint holds of a model given an indexer."""

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if not is_indexer_key(k)}

    def load_state_dict(self, state_dict: dict) -> None:
        for part in self.parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part) if k in state_dict}
            set_model_state_dict(part, own, options=StateDictOptions(strict=False))  # the indexer stays as it is


def _saved_metadata(path: Path) -> dict:
    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # a damaged pickle raises anything from UnpicklingError to EOFError
        raise ValueError(f"DCP metadata {path / '.metadata'} cannot be read ({type(err).__name__}: {err}); "
                         f"the checkpoint is damaged") from None


def _dcp_has_indexer(path: Path) -> bool:
    return any(k.startswith(MODEL_PREFIX) and is_indexer_key(k) for k in _saved_metadata(path))


def _check_dcp_model(model: nn.Module, path: Path, *, without_indexer: bool = False) -> None:
    saved = _saved_metadata(path)
    remedy = ("Build the model the checkpoint was saved from (model.flavor / model.hf_config_path), or pass a "
              "checkpoint of this model.")
    args = getattr(model, "args", None)
    if isinstance(args, KimiK3ModelArgs) and without_indexer:
        args = args.without_indexer()
    if isinstance(args, KimiK3ModelArgs):
        saved_args = read_model_args(path)
        if saved_args is not None:
            check_model_args(saved_args, args, f"DCP checkpoint {path}", remedy=remedy)
        check_saved_keys((k[len(MODEL_PREFIX):] for k in saved if k.startswith(MODEL_PREFIX)), args,
                         f"DCP checkpoint {path}", remedy=remedy, vision=getattr(model, "vision_args", None))
    wanted = ModelStateWithoutIndexer(model) if without_indexer else ModelState(model)
    missing = sorted(k for k in wanted.state_dict() if MODEL_PREFIX + k not in saved)
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"DCP checkpoint {path} lacks {len(missing)} key(s) of this model: {shown}.\n{remedy}")
