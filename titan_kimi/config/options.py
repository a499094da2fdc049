"""Declaring config fields with their meaning and valid values, and reading those declarations back.

Sections declare every field with `option(...)`; the loader, the validator and `--help` all read the
same `OptionSpec`, so a field's documentation and its checks cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bounds:
    """A numeric range, plus sentinel values allowed outside it (e.g. -1 = "derive it")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()

    def admits(self, x: float) -> bool:
        if x in self.also:
            return True
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        if self.high is not None and (x >= self.high if self.high_open else x > self.high):
            return False
        return True

    def describe(self) -> str:
        """The range in words, sentinels first: "-1 or >= 1", "in [0, 1)", "exactly 1"."""
        return " or ".join([_num(v) for v in self.also] + [self.range_text()])

    def range_text(self) -> str:
        if self.low is not None and self.low == self.high:
            return f"exactly {_num(self.low)}"
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "any value"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def at_least(low: float, *, also: tuple[float, ...] = ()) -> Bounds:
    return Bounds(low=low, also=also)


def above(low: float) -> Bounds:
    return Bounds(low=low, low_open=True)


def between(low: float, high: float, *, high_open: bool = False,
            also: tuple[float, ...] = ()) -> Bounds:
    return Bounds(low=low, high=high, high_open=high_open, also=also)


def option(default: Any, help: str, *, choices: tuple[str, ...] = (), bounds: Bounds | None = None,
           length: int | None = None, nonempty: bool = False, hint: str = "") -> Any:
    """A dataclass field carrying its meaning and its valid values.

    choices: allowed strings (for a list field: allowed elements); bounds: numeric range (for a list
    field: of each element); length: exact list length; nonempty: the string or list may not be empty;
    hint: a sentence added to errors about this key (why the limit exists, what to use instead).
    """
    metadata = {"help": help, "choices": tuple(choices), "bounds": bounds, "length": length,
                "nonempty": nonempty, "hint": hint}
    if isinstance(default, list):
        frozen = tuple(default)  # each instance gets its own list
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class OptionSpec:
    """Everything known about one config key."""

    section: str
    name: str
    kind: type            # str, int, float, bool or list
    item_kind: type | None  # element type of a list field
    default: Any
    help: str
    choices: tuple[str, ...]
    bounds: Bounds | None
    length: int | None
    nonempty: bool
    hint: str

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    def type_name(self) -> str:
        if self.kind is list:
            return f"list[{self.item_kind.__name__}]"
        return self.kind.__name__

    def valid(self) -> str:
        """What values this key accepts, in words."""
        if self.kind is bool:
            return "true or false"
        if self.kind is list:
            plural = {str: "strings", int: "integers", float: "numbers"}[self.item_kind]
            parts = [f"a list of {self.length} {plural}" if self.length else f"a list of {plural}"]
            if self.choices:
                parts.append("from " + "|".join(self.choices))
            if self.bounds:
                parts.append(self.bounds.describe())
            if self.nonempty:
                parts.append("(at least one)")
            return " ".join(parts)
        if self.choices:
            return "one of " + "|".join(self.choices)
        text = {int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.nonempty and self.kind is str:
            text = "a non-empty string"
        if self.bounds and self.bounds.low is not None and self.bounds.low == self.bounds.high:
            text = self.bounds.range_text()
        elif self.bounds:
            text = ", or ".join([_num(v) for v in self.bounds.also] + [f"{text} {self.bounds.range_text()}"])
        return text


def is_kind(kind: type, value: Any) -> bool:
    """isinstance for config values: bools are not ints, ints are accepted as floats."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kinds(annotation: Any) -> tuple[type, type | None]:
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return list, item
    if annotation in (str, int, float, bool):
        return annotation, None
    raise TypeError(f"config fields must be str, int, float, bool or list[...]; got {annotation!r}")


@functools.lru_cache(maxsize=None)
def describe_config(config_cls: type) -> dict[str, dict[str, OptionSpec]]:
    """{section: {key: OptionSpec}} for a top-level config dataclass whose fields are sections."""
    schema: dict[str, dict[str, OptionSpec]] = {}
    for section_field in dataclasses.fields(config_cls):
        section_cls = typing.get_type_hints(config_cls)[section_field.name]
        hints = typing.get_type_hints(section_cls)
        specs = {}
        for f in dataclasses.fields(section_cls):
            if "help" not in f.metadata:
                raise TypeError(f"{section_field.name}.{f.name} must be declared with option(...)")
            kind, item_kind = _kinds(hints[f.name])
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            specs[f.name] = OptionSpec(
                section=section_field.name, name=f.name, kind=kind, item_kind=item_kind,
                default=default, help=f.metadata["help"], choices=f.metadata["choices"],
                bounds=f.metadata["bounds"], length=f.metadata["length"],
                nonempty=f.metadata["nonempty"], hint=f.metadata["hint"])
        schema[section_field.name] = specs
    return schema
