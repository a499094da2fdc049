"""Splitting the command line into `--section.key value` overrides (no types known here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_kimi.config.errors import COMMAND_LINE, ConfigError

HELP_FLAGS = ("-h", "--help")
CONFIG_FILE_KEY = "job.config_file"


@dataclass(frozen=True)
class Override:
    """One `--key value`; text is None for a bare flag (which means true for a bool)."""

    key: str   # dotted, dashes already turned into underscores
    flag: str  # as typed, for messages
    text: str | None


@dataclass
class CommandLine:
    help: bool = False
    config_file: str | None = None
    overrides: list[Override] = field(default_factory=list)


def split_command_line(argv: list[str]) -> CommandLine:
    """Accepts `--a.b value`, `--a.b=value` and a bare `--a.b`; a token starting with `--` is not a value."""
    result = CommandLine(help=any(token in HELP_FLAGS for token in argv))
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in HELP_FLAGS:
            i += 1
            continue
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"{COMMAND_LINE}: unexpected argument {token!r}; options are written "
                "--section.key value or --section.key=value (see --help)", source=COMMAND_LINE, value=token)
        name, eq, text = token[2:].partition("=")
        if eq:
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            text = argv[i + 1]
            i += 2
        else:
            text = None
            i += 1
        key = name.replace("-", "_")
        override = Override(key=key, flag=f"--{name}", text=text)
        if key == CONFIG_FILE_KEY:
            if text is None:
                raise ConfigError(
                    f"{CONFIG_FILE_KEY} ({COMMAND_LINE}): value missing after {override.flag}; "
                    "valid: a path to a TOML recipe, e.g. --job.config_file train_configs/k31_debug.toml",
                    key=CONFIG_FILE_KEY, source=COMMAND_LINE)
            result.config_file = text  # the last one wins, like every other override
        else:
            result.overrides.append(override)
    return result
