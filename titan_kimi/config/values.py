"""Turning raw values into field values: TOML values are type-checked, command-line text is parsed.

Only types are checked here; choices and ranges are checked by validation, once every source is merged.
"""

from __future__ import annotations

import math
import re
from typing import Any

from titan_kimi.config.errors import ConfigError, bad_value, show
from titan_kimi.config.options import OptionSpec, is_kind

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_INT_TEXT = re.compile(r"[+-]?\d+(_\d+)*")
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def from_toml(spec: OptionSpec, value: Any, source: str) -> Any:
    """Checks a value read from TOML against the field's type; ints are accepted for floats."""
    if spec.kind is list:
        if not isinstance(value, list):
            raise bad_value(spec.path, value, source, f"expected a list, got {_type_word(value)}",
                            spec.valid(), hint=f"Write it as an array, e.g. {spec.name} = {_example(spec)}")
        return [_scalar_from_toml(spec, spec.item_kind, item, source, index, value)
                for index, item in enumerate(value)]
    return _scalar_from_toml(spec, spec.kind, value, source, None, value)


def from_text(spec: OptionSpec, text: str, source: str) -> Any:
    """Parses command-line text for a field: lists are comma-separated (brackets optional), bools accept
    true/false/yes/no/on/off/1/0, numbers must be finite and ints must be written as integers."""
    if spec.kind is list:
        inner = text.strip()
        if inner.startswith("[") and inner.endswith("]"):  # tolerate TOML-style brackets
            inner = inner[1:-1]
        items = [item.strip() for item in inner.split(",")] if inner.strip() else []
        return [_scalar_from_text(spec, spec.item_kind, item, source, index, text)
                for index, item in enumerate(items)]
    return _scalar_from_text(spec, spec.kind, text, source, None, text)


def _scalar_from_toml(spec: OptionSpec, kind: type, value: Any, source: str, index: int | None,
                      whole: Any) -> Any:
    if not is_kind(kind, value):
        raise _wrong_type(spec, kind, value, source, index, whole)
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise _wrong_type(spec, kind, value, source, index, whole, "not finite")
    return value


def _scalar_from_text(spec: OptionSpec, kind: type, text: str, source: str, index: int | None,
                      whole: str) -> Any:
    if kind is str:
        return text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise _wrong_type(spec, kind, text, source, index, whole, "not a boolean")
    stripped = text.strip()
    if kind is int:
        if _INT_TEXT.fullmatch(stripped):
            return int(stripped)
        problem = "a float, not an integer" if _is_float_text(stripped) else "not an integer"
        raise _wrong_type(spec, kind, text, source, index, whole, problem)
    if not _is_float_text(stripped):
        raise _wrong_type(spec, kind, text, source, index, whole, "not a number")
    value = float(stripped)
    if not math.isfinite(value):
        raise _wrong_type(spec, kind, text, source, index, whole, "not finite")
    return value


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _wrong_type(spec: OptionSpec, kind: type, value: Any, source: str, index: int | None, whole: Any,
                problem: str | None = None) -> ConfigError:
    problem = problem or f"expected {_TYPE_WORDS[kind]}, got {_type_word(value)}"
    if index is not None:
        problem = f"element {index} ({show(value)}): {problem}"
    return bad_value(spec.path, whole, source, problem, spec.valid(), spec.hint or None)


def _type_word(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _example(spec: OptionSpec) -> str:
    return show(spec.default) if spec.default else "[" + (
        f'"{spec.choices[0]}"' if spec.choices else "...") + "]"
