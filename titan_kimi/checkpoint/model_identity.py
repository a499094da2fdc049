"""Which model a checkpoint holds: the model args written next to every DCP step (``model_args.json``), and
the checks that a checkpoint's args and keys match the model it is loaded into.

Without them a K3.1 checkpoint "resumes" into a K3 model by dropping the indexer weights, and an HF folder
whose config.json disagrees with the flavor trains without a word.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Iterable

import torch

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.state_dict_adapter import args_from_hf_config
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

MODEL_ARGS_FILE = "model_args.json"
# An image-text model's tower and projector args, next to model_args.json (absent for a text model).
VISION_ARGS_FILE = "vision_args.json"
# Training settings (FLOP accounting, how the indexer trains, the DSA dense shortcut), not properties of the weights.
NOT_ARCHITECTURE = frozenset({"max_seq_len", "index_training", "dsa_dense_shortcut"})
# Not HF config fields (models/kimi_k3/state_dict_adapter.py): config.json cannot disagree about them.
NOT_IN_HF_CONFIG = frozenset({"mla_norm_eps", "index_norm_eps", *NOT_ARCHITECTURE})
_INDEXER_FIELDS = frozenset({"index_head_dim", "index_topk", "index_rope", "index_norm_eps"})


def args_to_json(args: KimiK3ModelArgs | KimiK3VisionArgs) -> dict[str, Any]:
    """The dataclass's fields as JSON values (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(args).items()}


def _write_args(path: Path, args: KimiK3ModelArgs | KimiK3VisionArgs) -> None:
    path.write_text(json.dumps(args_to_json(args), indent=1, sort_keys=True) + "\n")


def _read_args(path: Path, cls: type, what: str) -> Any:
    """``cls(**fields)`` from the JSON file ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        return cls(**fields)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: not a readable {what} file ({err}); the checkpoint step is damaged") from None


def write_model_args(folder: str | Path, args: KimiK3ModelArgs) -> None:
    _write_args(Path(folder) / MODEL_ARGS_FILE, args)


def read_model_args(folder: str | Path) -> KimiK3ModelArgs | None:
    """The args saved with a checkpoint step; None for a step saved before they were recorded."""
    return _read_args(Path(folder) / MODEL_ARGS_FILE, KimiK3ModelArgs, "model args")


def write_vision_args(folder: str | Path, vision: KimiK3VisionArgs) -> None:
    _write_args(Path(folder) / VISION_ARGS_FILE, vision)


def read_vision_args(folder: str | Path) -> KimiK3VisionArgs | None:
    """The tower args saved with an image-text checkpoint step; None for a text model (or an older save)."""
    return _read_args(Path(folder) / VISION_ARGS_FILE, KimiK3VisionArgs, "vision args")


def args_differences(saved: KimiK3ModelArgs, current: KimiK3ModelArgs,
                     ignore: Iterable[str] = NOT_ARCHITECTURE) -> list[str]:
    """``name: saved X, this model Y`` for every field that differs (indexer details only when one has it)."""
    skip = set(ignore)
    if not saved.has_indexer and not current.has_indexer:
        skip |= _INDEXER_FIELDS
    out = []
    for field in dataclasses.fields(KimiK3ModelArgs):
        a, b = getattr(saved, field.name), getattr(current, field.name)
        if field.name not in skip and a != b:
            out.append(f"{field.name}: {_show(a)} in the checkpoint, {_show(b)} in this model")
    return out


def check_model_args(saved: KimiK3ModelArgs, current: KimiK3ModelArgs, source: str, *,
                     ignore: Iterable[str] = NOT_ARCHITECTURE, remedy: str) -> None:
    """ValueError naming every differing field of ``saved`` (read from ``source``) and ``current``."""
    diffs = args_differences(saved, current, ignore)
    if diffs:
        raise ValueError(f"{source} holds a different model than this run builds ({len(diffs)} field"
                         f"{'s' if len(diffs) > 1 else ''} differ):\n  " + "\n  ".join(diffs) + f"\n{remedy}")


def check_same_indexer_training(saved: KimiK3ModelArgs, current: KimiK3ModelArgs, step_dir: str | Path) -> None:
    """A resume keeps ``indexer.mode``: the optimizer state of a run covers the weights its mode trains. Another
    stage starts from the weights alone."""
    if saved.index_training != current.index_training:
        raise ValueError(
            f"checkpoint {step_dir} was saved with indexer.mode = {saved.index_training!r}, and this run has "
            f"{current.index_training!r}: its optimizer state covers the weights the other mode trains. Resume "
            f"with indexer.mode = {saved.index_training!r}, or start the {current.index_training!r} stage from its "
            f"weights (a fresh optimizer and schedule): checkpoint.initial_load_path = {str(step_dir)!r} with "
            f"another checkpoint.folder or job.dump_folder")


@functools.lru_cache(maxsize=8)
def _full_model_keys(args_json: str, vision_json: str | None) -> frozenset[str]:
    from titan_kimi.models.kimi_k3.model import KimiK3Model
    from titan_kimi.models.kimi_k3.multimodal import KimiK3VLModel

    args = KimiK3ModelArgs(**json.loads(args_json))
    with torch.device("meta"):
        model = (KimiK3VLModel(args, KimiK3VisionArgs(**json.loads(vision_json))) if vision_json is not None
                 else KimiK3Model(args))
    return frozenset(model.state_dict())


def full_model_keys(args: KimiK3ModelArgs, vision: KimiK3VisionArgs | None = None) -> frozenset[str]:
    """Every state-dict key of the whole model with ``args`` (and the tower of ``vision``; built on the meta
    device: no memory)."""
    vision_json = json.dumps(dataclasses.asdict(vision), sort_keys=True) if vision is not None else None
    return _full_model_keys(json.dumps(args_to_json(args), sort_keys=True), vision_json)


def check_saved_keys(saved: Iterable[str], args: KimiK3ModelArgs, source: str, *, remedy: str,
                     vision: KimiK3VisionArgs | None = None) -> None:
    """ValueError when a checkpoint holds model keys that no tensor of a model with ``args`` (and ``vision``'s
    tower) has."""
    unexpected = sorted(set(saved) - full_model_keys(args, vision))
    if unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:5]) + (f" and {len(unexpected) - 5} more"
                                                             if len(unexpected) > 5 else "")
        raise ValueError(f"{source} holds {len(unexpected)} model key(s) this model does not have: {shown}; "
                         f"loading would drop them.\n{remedy}")


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def check_config_json(config: dict[str, Any], args: KimiK3ModelArgs, file: str | Path,
                      remedy: str | None = None) -> None:
    """ValueError naming every field where the checkpoint's config.json and the model's args disagree."""
    try:
        saved = args_from_hf_config(config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: cannot be read as a Kimi K3 config ({err})") from None
    check_model_args(saved, args, str(file), ignore=NOT_IN_HF_CONFIG, remedy=remedy or (
        f"Build the model from it (model.hf_config_path = {str(file)!r}; in Python from_pretrained), or choose "
        f"the model.flavor it was saved from."))
