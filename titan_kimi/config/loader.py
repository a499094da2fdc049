"""`load_job_config(argv)`: defaults, then the TOML recipe, then command-line overrides, then validation.

Imports nothing heavy (no torch), so `--help` and config errors are instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from titan_kimi.config.cli import CONFIG_FILE_KEY, CommandLine, Override, split_command_line
from titan_kimi.config.errors import COMMAND_LINE, ConfigError, bad_value, show, where
from titan_kimi.config.keys import lookup, suggest_key
from titan_kimi.config.options import OptionSpec
from titan_kimi.config.render import format_help, to_dict, to_toml
from titan_kimi.config.sections import JobConfig
from titan_kimi.config.validation import validate_job_config
from titan_kimi.config.values import from_text, from_toml

__all__ = ["ConfigError", "JobConfig", "format_help", "load_job_config", "read_toml", "to_dict", "to_toml"]


def load_job_config(argv: Sequence[str], *, environ: Mapping[str, str] | None = None,
                    check_registry: bool = True) -> JobConfig:
    """Builds and validates the job config from command-line arguments (sys.argv[1:]).

    Precedence is command line > TOML (`--job.config_file`) > defaults. Raises ConfigError on any
    invalid input, and SystemExit(0) after printing the help for `-h`/`--help`. environ (default
    os.environ) supplies the launcher's WORLD_SIZE, against which the parallel degrees are checked.
    ``check_registry=False`` leaves out the flavor names' check, which imports torch (for a look at the config
    before the trainer's imports; the trainer loads it again in full).
    """
    command_line = split_command_line(list(argv))
    if command_line.help:
        print(format_help(), end="")
        raise SystemExit(0)
    cfg = JobConfig()
    sources: dict[str, str] = {}
    if command_line.config_file:
        config_file = resolve_config_file(command_line.config_file)
        _apply_toml(cfg, read_toml(config_file), config_file, sources)
        cfg.job.config_file = config_file
        sources[CONFIG_FILE_KEY] = COMMAND_LINE
    _apply_overrides(cfg, command_line, sources)
    validate_job_config(cfg, sources, _launcher_world_size(os.environ if environ is None else environ),
                        check_registry=check_registry)
    return cfg


RECIPES_DIR = "train_configs"
REPO_RECIPES = Path(__file__).resolve().parents[2] / RECIPES_DIR  # the checkout's recipes, wherever we run


def recipe_places(path: str) -> list[Path]:
    """Where ``--job.config_file path`` is looked for, in order: as given, then (for a relative path)
    ``train_configs/<path>`` in the working folder and in the titan_kimi checkout."""
    given = Path(path)
    places = [given]
    if not given.is_absolute():
        places += [Path(RECIPES_DIR) / given, REPO_RECIPES / given]
    unique: list[Path] = []
    for place in places:
        if place.resolve() not in {p.resolve() for p in unique}:
            unique.append(place)
    return unique


def resolve_config_file(path: str) -> str:
    """The recipe ``--job.config_file`` names (``k31.toml`` finds ``train_configs/k31.toml``); a ConfigError
    naming every place looked in when none holds it."""
    places = recipe_places(path)
    for place in places:
        if place.is_file():
            return str(place)
    if len(places) == 1:
        return path  # read_toml reports it
    looked = ", ".join(str(p) for p in places)
    raise bad_value(CONFIG_FILE_KEY, path, COMMAND_LINE, f"no such file (looked in {looked})",
                    "a path to a TOML recipe, e.g. train_configs/<recipe>.toml or just <recipe>.toml")


def read_toml(path: str) -> dict[str, Any]:
    """Parses a TOML recipe; a missing file or a syntax error is a ConfigError naming the file."""
    file = Path(path)
    if not file.is_file():
        problem = "is a folder, not a TOML file" if file.is_dir() else "no such file"
        raise bad_value(CONFIG_FILE_KEY, path, COMMAND_LINE, problem,
                        "a path to a TOML recipe, e.g. train_configs/<recipe>.toml")
    try:
        with file.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}", key=CONFIG_FILE_KEY, source=path,
                          value=path) from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text: {error}", key=CONFIG_FILE_KEY, source=path,
                          value=path) from None


def _apply_toml(cfg: JobConfig, document: dict[str, Any], path: str, sources: dict[str, str]) -> None:
    for section, table in document.items():
        if not isinstance(table, dict):
            guess = suggest_key("", section)
            hint = f" (did you mean [{guess.replace('.', '] ')}?)" if guess else ""
            raise ConfigError(f"{section} = {show(table)} ({where(path)}): keys must be inside a "
                              f"[section]{hint}", key=section, source=path, value=table)
        for key, value in table.items():
            spec = lookup(section, key, value, path)
            if spec.path == CONFIG_FILE_KEY:
                raise bad_value(CONFIG_FILE_KEY, value, path, "a recipe cannot name its own file",
                                "remove it; pass --job.config_file on the command line")
            setattr(getattr(cfg, section), key, from_toml(spec, value, path))
            sources[spec.path] = path


def _apply_overrides(cfg: JobConfig, command_line: CommandLine, sources: dict[str, str]) -> None:
    for override in command_line.overrides:
        section, dot, key = override.key.partition(".")
        if not dot:
            section, key = "", override.key
        spec = lookup(section, key, True if override.text is None else override.text, COMMAND_LINE)
        setattr(getattr(cfg, section), key, _override_value(spec, override))
        sources[spec.path] = COMMAND_LINE


def _override_value(spec: OptionSpec, override: Override) -> Any:
    if override.text is not None:
        return from_text(spec, override.text, COMMAND_LINE)
    if spec.kind is bool:
        return True  # a bare boolean flag means true
    raise ConfigError(f"{spec.path} ({where(COMMAND_LINE)}): value missing after {override.flag}; "
                      f"valid: {spec.valid()} (write {override.flag} VALUE or {override.flag}=VALUE)",
                      key=spec.path, source=COMMAND_LINE)


def _launcher_world_size(environ: Mapping[str, str]) -> int | None:
    text = environ.get("WORLD_SIZE")
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"environment: WORLD_SIZE = {text!r} is not a positive integer; check the launcher",
                          key="WORLD_SIZE", source="environment", value=text)
    return int(text)
