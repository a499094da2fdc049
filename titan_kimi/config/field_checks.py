"""Checks of one key at a time against its declaration: type, choices, range, length, emptiness."""

from __future__ import annotations

import difflib
from typing import Any

from titan_kimi.config.errors import bad_value, show
from titan_kimi.config.options import OptionSpec, is_kind


def check_field(spec: OptionSpec, value: Any, source: str) -> None:
    """Raises ConfigError if `value` is not a valid value for `spec`."""
    if not _has_kind(spec, value):
        raise _error(spec, value, source, f"expected {spec.type_name()}, got {type(value).__name__}")
    if spec.nonempty and (not value or (isinstance(value, str) and not value.strip())):
        raise _error(spec, value, source, "must not be empty")
    if spec.kind is list:
        if spec.length is not None and len(value) != spec.length:
            plural = "" if len(value) == 1 else "s"
            raise _error(spec, value, source, f"has {len(value)} element{plural}, needs {spec.length}")
        for index, item in enumerate(value):
            _check_scalar(spec, item, source, value, f"element {index} ({show(item)}) is ")
        if spec.item_kind is str and len(set(value)) != len(value):
            duplicates = sorted({item for item in value if value.count(item) > 1})
            raise _error(spec, value, source, f"lists {', '.join(duplicates)} more than once")
    else:
        _check_scalar(spec, value, source, value, "")


def _check_scalar(spec: OptionSpec, item: Any, source: str, whole: Any, prefix: str) -> None:
    if spec.choices and item not in spec.choices:
        close = difflib.get_close_matches(str(item).lower(), [c.lower() for c in spec.choices], n=1)
        did_you_mean = ""
        if close:
            match = next(c for c in spec.choices if c.lower() == close[0])
            did_you_mean = f" (did you mean {show(match)}?)"
        raise _error(spec, whole, source, f"{prefix}not a valid choice{did_you_mean}")
    if spec.bounds and not spec.bounds.admits(item):
        raise _error(spec, whole, source, f"{prefix}out of range")


def _has_kind(spec: OptionSpec, value: Any) -> bool:
    if spec.kind is list:
        return isinstance(value, list) and all(is_kind(spec.item_kind, item) for item in value)
    return is_kind(spec.kind, value)


def _error(spec: OptionSpec, value: Any, source: str, problem: str):
    return bad_value(spec.path, value, source, problem, spec.valid(), spec.hint or None)
