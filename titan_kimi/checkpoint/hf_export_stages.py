"""HF export of a pipelined model: every rank passes its stages, and one HF checkpoint comes out.

Each stage's tensors are gathered within the stage's own meshes (FSDP/EP DTensors -> ``full_tensor``; never
across pipeline ranks) and written by the stage's first rank (the lowest global rank of its pipeline rank) as
its own shards into one shared temporary folder. After every writer is done, rank 0 renames the shards in
layer order to ``model-0000i-of-0000N.safetensors``, writes the index and config.json and renames the folder
into place: a crash before that leaves only the hidden ``.<name>.tmp`` folder, which the next export removes.

The keys, values, index total and config.json equal a one-process export of the same weights. The shard
boundaries follow the stages (a shard never spans two stages), so the file names map differently.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_kimi.checkpoint.dcp_states import global_rank
from titan_kimi.checkpoint.destinations import owned_state
from titan_kimi.checkpoint.hf_export import ExportSettings, export_config, write_state
from titan_kimi.checkpoint.hf_writer import (HFShardWriter, ShardPart, check_target, commit_folder, prepare_tmp,
                                             tmp_folder)
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

TensorsOf = Callable[[nn.Module], Mapping[str, torch.Tensor]]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _raise_any(errors: Sequence[str | None]) -> None:
    """Every rank raises the same error when any rank failed, instead of hanging in the next collective."""
    failed = [e for e in errors if e]
    if failed:
        raise ValueError(failed[0])


def _check_stages(parts: Sequence[nn.Module]) -> KimiK3ModelArgs:
    if not parts:
        raise ValueError("export_hf_stages needs at least one model part (this rank's pipeline stages)")
    args = getattr(parts[0], "args", None)
    for part in parts:
        if not isinstance(getattr(part, "args", None), KimiK3ModelArgs) or not hasattr(part, "first_layer"):
            raise ValueError(f"export_hf_stages needs Kimi K3 models or stages with .args; got {type(part).__name__}")
        if part.args != args:
            raise ValueError("the model parts were built with different model args; they are not one model")
    return args


def _check_coverage(stages: list[tuple[int, int]], n_layers: int) -> None:
    """The stages of all ranks hold every layer exactly once (else the checkpoint would be partial)."""
    expected = 0
    for first, last in sorted(stages):
        if first != expected:
            raise ValueError(f"the pipeline stages {sorted(stages)} do not cover layers [0, {n_layers}) once each "
                             f"(gap or overlap at layer {expected}); every rank must pass all its stages")
        expected = last
    if expected != n_layers:
        raise ValueError(f"the pipeline stages {sorted(stages)} end at layer {expected}, not at {n_layers}")


def export_hf_stages(
    parts: Sequence[nn.Module],
    path: str | Path,
    *,
    group: dist.ProcessGroup | None = None,
    tensors_of: TensorsOf | None = None,
    **settings: Any,
) -> Path:
    """Write the model whose stages ``parts`` this rank holds as one HF checkpoint folder at ``path``.

    Every rank calls this with its stages (in any order); ``group`` is the pipeline group (this rank's pipeline
    rank is its rank in it; None: one process holds every stage). ``tensors_of(part)`` replaces a part's
    state as what is written (``titan_kimi.lora.merged_tensors``: adapters merged). ``settings`` are
    ``ExportSettings``' fields, as for ``export_hf_checkpoint``. The folder must be visible to every writing
    rank (a shared file system, as for DCP saves).
    """
    args = _check_stages(parts)
    options = ExportSettings(**settings)
    overwrite = options.overwrite
    check_target(path, overwrite)
    rank = global_rank()
    pp_rank = dist.get_rank(group) if group is not None else 0
    pp_ranks = _all_gather(pp_rank)
    writes = rank == min(r for r, p in enumerate(pp_ranks) if p == pp_rank)  # the stage's first rank
    stages = [(part.first_layer, part.last_layer) for part in parts]

    error = None
    if rank == 0:
        try:
            prepare_tmp(path, overwrite)
        except (OSError, ValueError) as err:
            error = f"HF export to {path}: cannot start {tmp_folder(path)}: {err}"
    _raise_any(_all_gather(error))

    written: list[tuple[int, list[ShardPart]]] = []
    error = None
    try:
        for part in sorted(parts, key=lambda p: p.first_layer):
            # A prefix per stage: the stages' writers share one folder.
            writer = HFShardWriter(path, max_shard_bytes=options.max_shard_bytes, overwrite=overwrite,
                                   enabled=writes, prepare=False, part_prefix=f"stage-{part.first_layer:05d}")
            state = tensors_of(part) if tensors_of is not None else owned_state(part)
            write_state(part, state, writer, settings=options)
            written.append((part.first_layer, writer.finish()))
    except (OSError, RuntimeError, ValueError) as err:
        error = f"HF export to {path} failed on rank {rank}, nothing was replaced: {err}"
    gathered = _all_gather((stages if writes else [], written, error))
    if rank == 0 and any(e for _, _, e in gathered):
        shutil.rmtree(tmp_folder(path), ignore_errors=True)  # the other writers are done with it (gathered)
    _raise_any([e for _, _, e in gathered])

    error = None
    if rank == 0:
        try:
            _check_coverage([s for ranges, _, _ in gathered for s in ranges], args.n_layers)
            ordered = sorted((first, i, part) for _, stage_parts, _ in gathered
                             for first, files in stage_parts for i, part in enumerate(files))
            config = export_config(parts[0], options)
            commit_folder(path, [part for _, _, part in ordered], {"config.json": config}, overwrite=overwrite)
        except (OSError, ValueError) as err:
            shutil.rmtree(tmp_folder(path), ignore_errors=True)
            error = f"HF export to {path} failed, nothing was replaced: {err}"
    _raise_any(_all_gather(error))
    return Path(path)
