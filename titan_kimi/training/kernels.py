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


# The libraries behind backends that import lazily, at their first call.
_BACKEND_MODULES = {
    ("kda", "fla"): ("fla.modules.norm.l2norm", "fla.ops.kda.chunk_fwd", "fla.ops.kda.chunk_bwd",
                     "fla.ops.utils.index"),
    ("linear_cross_entropy", "liger"): ("liger_kernel.ops.fused_linear_cross_entropy",),
}


def import_backend_libraries(resolved: dict[str, Any]) -> list[str]:
    """Import the chosen backends' libraries before the first step (after FLA's configs are prepared, which FLA
    reads at import). Imported inside the first step, a library that registers pytree nodes changes a guard of
    every graph compiled before it, and Dynamo compiles those again at step 2. Returns the modules imported."""
    import importlib

    names = [name for (op, backend), modules in _BACKEND_MODULES.items() if resolved.get(op) == backend
             for name in modules]
    for name in names:
        importlib.import_module(name)
    return names
