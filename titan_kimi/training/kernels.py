"""Applying the ``[kernels]`` section: every op of lowerings/catalog.py gets its backend, and the kernel
settings (autotuning, the Gluon sparse-MLA forward, FLA's configs) are set; nothing is read from the
environment."""

from __future__ import annotations

import os
from typing import Any

from lowerings.catalog import BACKEND_OPS
from lowerings.ops import configure_backends
from lowerings.settings import KernelSettings, configure_kernel_settings, refuse_replaced_environment

SETTINGS = tuple(KernelSettings.__dataclass_fields__)


def configure_kernels(kernels: Any) -> dict[str, Any]:
    """Validates and applies the section (nothing changes if a backend cannot run here); returns
    ``{op: resolved backend, setting: value}`` for the log line."""
    refuse_replaced_environment(os.environ)
    resolved: dict[str, Any] = configure_backends({op: getattr(kernels, op) for op in BACKEND_OPS})
    settings = configure_kernel_settings(**{name: getattr(kernels, name) for name in SETTINGS})
    resolved.update({name: getattr(settings, name) for name in SETTINGS})
    return resolved


def describe(resolved: dict[str, Any]) -> str:
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in resolved.items())
