"""Finding the declaration of a `section.key`, with a suggestion of the closest valid key when it has none."""

from __future__ import annotations

import difflib
from typing import Any

from titan_kimi.config.errors import ConfigError, show, where
from titan_kimi.config.options import OptionSpec, describe_config
from titan_kimi.config.sections import JobConfig


def lookup(section: str, key: str, value: Any, source: str) -> OptionSpec:
    """The spec of `section.key`; a ConfigError naming the closest valid key if there is none."""
    schema = describe_config(JobConfig)
    if section in schema and key in schema[section]:
        return schema[section][key]
    label = f"{section}.{key}" if section else key
    if section not in schema:
        problem = f"unknown section [{section}]" if section else "not a section.key name"
        close = difflib.get_close_matches(section, list(schema), n=1, cutoff=0.6) if section else []
        if close:
            guess = f"{close[0]}.{key}" if key in schema[close[0]] else f"[{close[0]}]"
        else:
            guess = suggest_key(section, key)
        valid = "sections " + ", ".join(schema)
    else:
        problem = f"unknown key in [{section}]"
        guess = suggest_key(section, key)
        valid = f"keys of [{section}]: " + ", ".join(schema[section])
    if guess:
        problem += f" (did you mean {guess}?)"
    message = f"{label} = {show(value)} ({where(source)}): {problem}; valid: {valid}"
    raise ConfigError(message, key=label, source=source, value=value)


def suggest_key(section: str, key: str) -> str | None:
    """The valid `section.key` a user most likely meant, or None."""
    schema = describe_config(JobConfig)
    same_name = [f"{other}.{key}" for other, specs in schema.items() if key in specs]
    if same_name:
        return same_name[0]
    if section in schema:
        close = difflib.get_close_matches(key, list(schema[section]), n=1, cutoff=0.6)
        if close:
            return f"{section}.{close[0]}"
    paths = [f"{other}.{name}" for other, specs in schema.items() for name in specs]
    close = difflib.get_close_matches(f"{section}.{key}", paths, n=1, cutoff=0.6)
    return close[0] if close else None
