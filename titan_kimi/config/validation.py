"""Validating a whole JobConfig before any work starts: each key, cross-key rules, the flavor registry."""

from __future__ import annotations

import importlib
from typing import Mapping

from titan_kimi.config.errors import DEFAULT, IN_CODE, bad_value
from titan_kimi.config.field_checks import check_field
from titan_kimi.config.options import describe_config
from titan_kimi.config.parallelism import check_degrees
from titan_kimi.config.rules import RULES
from titan_kimi.config.sections import JobConfig

FLAVORS_MODULE = "titan_kimi.models.kimi_k3.flavors"
VISION_FLAVORS_MODULE = "titan_kimi.models.kimi_k3.vision_args"
LAUNCHER = "WORLD_SIZE from the launcher"


def validate_job_config(cfg: JobConfig, sources: Mapping[str, str] | None = None,
                        launcher_world_size: int | None = None, *, check_registry: bool = True) -> None:
    """Raises ConfigError on the first invalid value.

    sources maps "section.key" to where its value came from (a TOML path or "command line"); keys not in
    it are reported as defaults, or, when no sources are given (a config built in code), as set on the
    object. launcher_world_size is the launcher's WORLD_SIZE, if any: the parallel degrees are checked
    against job.world_size or against it, and only when one of them is known. check_registry=False skips the
    flavor names (the model registry imports torch).
    """
    unlisted = DEFAULT if sources is not None else IN_CODE
    sources = sources or {}

    def source_of(key: str) -> str:
        return sources.get(key, unlisted)

    for section, specs in describe_config(JobConfig).items():
        values = getattr(cfg, section)
        for name, spec in specs.items():
            check_field(spec, getattr(values, name), source_of(spec.path))
    for rule in RULES:
        rule(cfg, source_of)

    requested = cfg.job.world_size
    if requested and launcher_world_size and requested != launcher_world_size:
        raise bad_value("job.world_size", requested, source_of("job.world_size"),
                        f"the launcher started {launcher_world_size} ranks", f"0 or {launcher_world_size}")
    # The parallel layout's checks that need no model (the rest: titan_kimi.parallel.layout.check_layout).
    world, world_source = (requested, "job.world_size") if requested else (launcher_world_size or None, LAUNCHER)
    check_degrees(cfg, world, image_text=bool(cfg.model.vision_flavor), source_of=source_of, world_source=world_source)
    # Last: the registry lives in the model package, which imports torch; every other error stays instant.
    if not check_registry:
        return
    _check_flavor(cfg, source_of("model.flavor"))
    _check_vision_flavor(cfg, source_of("model.vision_flavor"))


def known_flavors() -> list[str]:
    """The model registry's flavor names (imported late: it pulls in torch, which --help must not wait for)."""
    return list(importlib.import_module(FLAVORS_MODULE).flavor_names())


def _check_flavor(cfg: JobConfig, source: str) -> None:
    names = known_flavors()
    if cfg.model.flavor not in names:
        raise bad_value("model.flavor", cfg.model.flavor, source, "not a known flavor",
                        "one of " + "|".join(names))


def _check_vision_flavor(cfg: JobConfig, source: str) -> None:
    if not cfg.model.vision_flavor:
        return
    names = list(importlib.import_module(VISION_FLAVORS_MODULE).vision_flavor_names())
    if cfg.model.vision_flavor not in names:
        raise bad_value("model.vision_flavor", cfg.model.vision_flavor, source, "not a known vision flavor",
                        "\"\" (a text model) or one of " + "|".join(names))
