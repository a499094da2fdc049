"""The one error type of the config layer, and how it renders values and their sources."""

from __future__ import annotations

import json
from typing import Any

# Source labels for where a value came from; a TOML path is used as-is.
COMMAND_LINE = "command line"
DEFAULT = "default"
IN_CODE = "config object"  # validated without a record of where values came from


class ConfigError(ValueError):
    """A job config that cannot be used. The message names the key, where its value came from
    (the TOML file, the command line or the default), the bad value and what would be valid."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None,
                 value: Any = None) -> None:
        super().__init__(message)
        self.key = key
        self.source = source
        self.value = value


def show(value: Any) -> str:
    """Renders a value the way it would be written in TOML, so messages can be pasted back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def where(source: str) -> str:
    if source == COMMAND_LINE:
        return "from the command line"
    if source == DEFAULT:
        return "the default"
    if source == IN_CODE:
        return "set on the JobConfig object"
    return f"from {source}"


def bad_value(key: str, value: Any, source: str | None, problem: str, valid: str | None = None,
              hint: str | None = None) -> ConfigError:
    """Builds the standard message: `key = value (from FILE): problem; valid: ...` (without the source when it
    is None: a config checked after loading, whose sources are no longer known)."""
    message = f"{mention(key, value, source)}: {problem}"
    if valid:
        message += f"; valid: {valid}"
    if hint:
        message += f". {hint}"
    return ConfigError(message, key=key, source=source, value=value)


def mention(key: str, value: Any, source: str | None) -> str:
    """`key = value (from FILE)`, for naming the other side of a conflict between two keys."""
    return f"{key} = {show(value)}" + (f" ({where(source)})" if source is not None else "")
