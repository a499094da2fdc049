"""Printing configs: the resolved config as a dict or TOML, and `--help` listing every key."""

from __future__ import annotations

from typing import Any

from titan_kimi.config.cli import CONFIG_FILE_KEY
from titan_kimi.config.errors import show
from titan_kimi.config.options import describe_config
from titan_kimi.config.sections import JobConfig

USAGE = ("usage: torchrun --nproc-per-node=N -m titan_kimi.train --job.config_file train_configs/RECIPE.toml "
         "[--section.key VALUE ...]")


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}}, lists copied, in declaration order."""
    return {section: {name: _copy(getattr(getattr(cfg, section), name)) for name in specs}
            for section, specs in describe_config(JobConfig).items()}


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as a TOML document that load_job_config reads back to the same config.

    job.config_file is written as a comment: a recipe cannot name itself (it is set on the command line).
    """
    blocks = []
    for section, values in to_dict(cfg).items():
        lines = [f"[{section}]"]
        for name, value in values.items():
            comment = "# " if f"{section}.{name}" == CONFIG_FILE_KEY else ""
            lines.append(f"{comment}{name} = {show(value)}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def format_help() -> str:
    """Every key grouped by section, with its type, default, meaning and valid values."""
    lines = [
        USAGE,
        "",
        "Precedence: command line > TOML file > defaults. Override any key as --section.key VALUE or",
        "--section.key=VALUE (dashes may replace underscores). Lists are comma-separated; a boolean flag",
        "alone means true (--checkpoint.enable), or give the value (--checkpoint.enable false).",
    ]
    for section, specs in describe_config(JobConfig).items():
        lines += ["", f"[{section}]"]
        for spec in specs.values():
            lines.append(f"  --{spec.path} ({spec.type_name()}, default: {show(spec.default)})")
            lines.append(f"      {spec.help}")
            if spec.choices or spec.bounds or spec.length:
                lines.append(f"      valid: {spec.valid()}")
    return "\n".join(lines) + "\n"


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
