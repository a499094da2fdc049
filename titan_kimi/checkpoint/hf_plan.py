"""Plan an HF load from the headers alone: every needed key's presence, shape and dtype is checked before any
destination is touched, so a bad checkpoint fails without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Sequence

import torch

from titan_kimi.checkpoint.destinations import Destination
from titan_kimi.checkpoint.hf_index import FLOAT_DTYPES, SCALE_DTYPES, HFCheckpoint, ShardFileError
from titan_kimi.checkpoint.mxfp4 import mxfp4_shapes
from titan_kimi.models.kimi_k3.state_dict_adapter import (
    A_LOG_PAD_MULTIPLE,
    PASSTHROUGH_PREFIXES,
    TEXT_PREFIX,
    HFSource,
    Piece,
    plan_key,
)

DENSE, PADDED, MXFP4 = "dense", "padded", "mxfp4"


@dataclass(frozen=True)
class Read:
    """Copy ``src`` (a box of the logical HF tensor) into ``dst`` (an index of the local destination tensor)."""

    fqn: str
    kind: str  # DENSE, PADDED (A_log) or MXFP4
    keys: tuple[str, ...]  # (key,) or (packed_key, scale_key)
    file: str
    src: tuple[slice, ...]
    dst: tuple[int | slice, ...]


@dataclass
class LoadPlan:
    reads: list[Read] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)  # model keys that will be filled
    missing: list[str] = field(default_factory=list)  # model keys left untouched (strict=False only)
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys no model of this config owns
    skipped: list[str] = field(default_factory=list)  # vision/projector keys a text-only model does not own

    @property
    def files(self) -> list[str]:
        return sorted({r.file for r in self.reads})


def _intersect(piece: Piece, dest: Destination) -> tuple[tuple[slice, ...], tuple[int | slice, ...]] | None:
    """Source box and destination index of the part of ``piece`` this destination owns, or None."""
    lead = len(piece.offset) - len(piece.source.shape)
    src: list[slice] = []
    dst: list[int | slice] = []
    for d, (p, b, o, s) in enumerate(zip(piece.offset, piece.box_shape, dest.offset, dest.local_shape)):
        lo, hi = max(p, o), min(p + b, o + s)
        if lo >= hi:
            return None
        if d < lead:
            dst.append(lo - o)  # a leading singleton dim of the box (the expert index)
        else:
            src.append(slice(lo - p, hi - p))
            dst.append(slice(lo - o, hi - o))
    return tuple(src), tuple(dst)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class _Planner:
    def __init__(self, ckpt: HFCheckpoint, fp32_names: AbstractSet[str]) -> None:
        self.ckpt = ckpt
        self.fp32_names = fp32_names
        self.errors: list[str] = []
        self.not_fp32: list[str] = []
        self.missing_files: set[str] = set()

    def where(self, key: str) -> str:
        return f"{key!r} in {self.ckpt.file_of(key)}" if key in self.ckpt else repr(key)

    def header(self, key: str):
        try:
            return self.ckpt.header(key)
        except ShardFileError as err:
            # One message per missing or unreadable file, not one per key; "" still marks this source as failed.
            self.errors.append("" if err.file in self.missing_files else str(err))
            self.missing_files.add(err.file)
            return None
        except ValueError as err:
            self.errors.append(str(err))
            return None

    def check_dest(self, dest: Destination) -> bool:
        if not dest.local.is_floating_point():
            self.errors.append(
                f"model key {dest.fqn!r} has dtype {dest.local.dtype}; only floating tensors can be loaded"
            )
            return False
        if dest.fqn in self.fp32_names and dest.local.dtype != torch.float32:
            self.not_fp32.append(f"{dest.fqn!r} ({dest.local.dtype})")
            return False
        return True

    def fp32_error(self) -> list[str]:
        if not self.not_fp32:
            return []
        shown = ", ".join(self.not_fp32[:3]) + (f" and {len(self.not_fp32) - 3} more" if len(self.not_fp32) > 3 else "")
        return [
            f"model keys {shown} must be float32 (the model keeps them in fp32 whatever its dtype); build the "
            f"model with titan_kimi.models.kimi_k3.init.cast_model_dtype instead of model.to(dtype)"
        ]

    def check_dense(self, key: str, want: tuple[int, ...], fqn: str) -> bool:
        head = self.header(key)
        if head is None:
            return False
        ok = True
        if head.dtype not in FLOAT_DTYPES:
            self.errors.append(
                f"{self.where(key)}: dtype {head.dtype} cannot be converted to the floating model tensor {fqn!r}; "
                f"valid dtypes: {sorted(FLOAT_DTYPES)}"
            )
            ok = False
        if head.shape != want:
            self.errors.append(
                f"{self.where(key)}: shape {_fmt(head.shape)} does not match model key {fqn!r}, expected {_fmt(want)}"
            )
            ok = False
        return ok

    def check_a_log(self, source: HFSource, fqn: str) -> bool:
        key, (n,) = source.key, source.shape
        head = self.header(key)
        if head is None:
            return False
        if head.dtype not in FLOAT_DTYPES:
            self.errors.append(
                f"{self.where(key)}: dtype {head.dtype} cannot be converted to {fqn!r}; valid: {sorted(FLOAT_DTYPES)}"
            )
            return False
        padded = -(-n // A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE
        if len(head.shape) != 1 or head.shape[0] not in (n, padded):
            self.errors.append(
                f"{self.where(key)}: shape {_fmt(head.shape)} is invalid for {fqn!r} with {n} heads; "
                f"expected [{padded}] (zero-padded to a multiple of {A_LOG_PAD_MULTIPLE}) or [{n}]"
            )
            return False
        if head.shape[0] > n:
            tail = self.ckpt.read(key, (slice(n, head.shape[0]),))
            if torch.count_nonzero(tail):
                bad = int(torch.nonzero(tail)[0, 0]) + n
                self.errors.append(
                    f"{self.where(key)}: the padding beyond the {n} real heads must be zero, but entry {bad} is "
                    f"{tail[bad - n].item()}; the checkpoint does not match a model with {n} KDA heads"
                )
                return False
        return True

    def check_mxfp4(self, source: HFSource, fqn: str) -> bool:
        packed_head, scale_head = self.header(source.packed_key), self.header(source.scale_key)
        if packed_head is None or scale_head is None:
            return False
        want_packed, want_scale = mxfp4_shapes(source.shape)
        ok = True
        if packed_head.dtype != "U8" or scale_head.dtype not in SCALE_DTYPES:
            self.errors.append(
                f"{self.where(source.packed_key)}: MXFP4 pair has dtypes ({packed_head.dtype}, {scale_head.dtype}); "
                f"expected packed U8 and scale U8"
            )
            ok = False
        if packed_head.shape != want_packed or scale_head.shape != want_scale:
            self.errors.append(
                f"{self.where(source.packed_key)}: MXFP4 shapes packed {_fmt(packed_head.shape)}, scale "
                f"{_fmt(scale_head.shape)} do not match model key {fqn!r}; expected packed {_fmt(want_packed)} "
                f"and scale {_fmt(want_scale)} for logical {_fmt(source.shape)}"
            )
            ok = False
        return ok

    def resolve(self, source: HFSource, fqn: str) -> tuple[str, tuple[str, ...]] | None:
        """(kind, physical keys) of ``source``, with its checks; None (and an error) when it is unusable."""
        ckpt = self.ckpt
        if source.expert:
            has_dense, has_packed, has_scale = (k in ckpt for k in (source.key, source.packed_key, source.scale_key))
            if has_packed != has_scale:
                present, absent = (source.packed_key, source.scale_key)
                if has_scale:
                    present, absent = absent, present
                self.errors.append(
                    f"{self.where(present)}: incomplete MXFP4 pair, {absent!r} is missing (model key {fqn!r})"
                )
                return None
            if has_dense and has_packed:
                self.errors.append(
                    f"{self.where(source.key)}: the checkpoint holds both {source.key!r} and its MXFP4 pair; keep one"
                )
                return None
            if has_packed:
                return (MXFP4, (source.packed_key, source.scale_key)) if self.check_mxfp4(source, fqn) else None
        if source.key not in ckpt:
            return None  # missing: the caller decides (strict or not)
        if source.padded:
            return (PADDED, (source.key,)) if self.check_a_log(source, fqn) else None
        return (DENSE, (source.key,)) if self.check_dense(source.key, source.shape, fqn) else None


def plan_load(
    ckpt: HFCheckpoint,
    destinations: Sequence[Destination],
    *,
    fp32_names: AbstractSet[str],
    expected_keys: AbstractSet[str] | None,
    strict: bool = True,
    expected_vision_keys: AbstractSet[str] | None = None,
) -> LoadPlan:
    """Validate and plan filling ``destinations`` from ``ckpt``; raises one ValueError listing every problem.

    ``expected_keys`` are all HF keys a full model of this configuration may own (for the unexpected-key check).
    ``expected_vision_keys``, for an image-text model, are those of its tower and projector: other vision keys
    are unexpected (a tower of another depth); without it every vision key the model does not own is skipped
    (a text model reading an image-text checkpoint).
    """
    planner, plan = _Planner(ckpt, fp32_names), LoadPlan()
    missing_errors: list[str] = []
    for dest in destinations:
        try:
            key_plan = plan_key(dest.fqn, dest.global_shape)
        except ValueError as err:
            if strict:
                missing_errors.append(str(err))
            else:
                plan.missing.append(dest.fqn)
            continue
        if not planner.check_dest(dest):
            continue
        reads, absent, failed = [], [], False
        for piece in key_plan.pieces:
            boxes = _intersect(piece, dest)
            if boxes is None:
                # Another rank owns this part: only check presence (no file is opened), so every rank that
                # shares the tensor agrees on a missing key instead of some ranks loading and others failing.
                if not any(name in ckpt for name in piece.source.disk_names()):
                    absent.append(piece.source.key)
                continue
            before = len(planner.errors)
            resolved = planner.resolve(piece.source, dest.fqn)
            if resolved is None:
                failed |= len(planner.errors) > before
                if len(planner.errors) == before:
                    absent.append(piece.source.key)
                continue
            kind, keys = resolved
            reads.append(Read(dest.fqn, kind, keys, ckpt.file_of(keys[0]), *boxes))
        if failed:
            continue
        if absent:
            if strict:
                forms = " (or its MXFP4 .weight_packed/.weight_scale pair)" if ".experts." in absent[0] else ""
                more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
                missing_errors.append(
                    f"HF checkpoint {ckpt.path}: key {absent[0]!r}{forms}{more} needed by model key {dest.fqn!r} "
                    f"is missing"
                )
            else:
                plan.missing.append(dest.fqn)
            continue
        plan.reads.extend(reads)
        plan.loaded.append(dest.fqn)
    owned_passthrough = {d.fqn for d in destinations if d.fqn.startswith(PASSTHROUGH_PREFIXES)}
    for key in ckpt.keys():
        if key.startswith(PASSTHROUGH_PREFIXES):
            if expected_vision_keys is not None and key not in expected_vision_keys:
                plan.unexpected.append(key)
            elif key not in owned_passthrough:
                plan.skipped.append(key)
        elif expected_keys is not None and (not key.startswith(TEXT_PREFIX) or key not in expected_keys):
            plan.unexpected.append(key)
    errors = planner.fp32_error() + [e for e in planner.errors if e] + missing_errors
    if strict and plan.unexpected:
        shown = ", ".join(repr(k) for k in plan.unexpected[:5]) + (" ..." if len(plan.unexpected) > 5 else "")
        errors.append(
            f"HF checkpoint {ckpt.path}: {len(plan.unexpected)} unexpected key(s) that no tensor of this model "
            f"configuration maps to: {shown} (in {ckpt.file_of(plan.unexpected[0])}); pass strict=False to ignore"
        )
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise ValueError("cannot load the HF checkpoint, nothing was loaded:\n  " + "\n  ".join(shown))
    return plan


__all__ = ["DENSE", "MXFP4", "PADDED", "LoadPlan", "Read", "plan_load"]
