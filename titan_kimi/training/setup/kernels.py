"""Applying the ``[kernels]`` section: every op of lowerings/catalog.py gets its backend, and the kernel
settings (autotuning, the Gluon sparse-MLA forward, FLA's configs) are set; nothing is read from the
environment."""

from __future__ import annotations

import os
from typing import Any

from lowerings.catalog import BACKEND_OPS
from lowerings.kernels.fla_kda import FLA_DEFERRED_PACKAGES, FLA_MODULES
from lowerings.ops import configure_backends
from lowerings.settings import KernelSettings, configure_kernel_settings, refuse_replaced_environment

SETTINGS = tuple(KernelSettings.__dataclass_fields__)


def unused_ops(args: Any) -> set[str]:
    """The ``[kernels]`` ops a model of these args never calls: the indexer and sparse MLA without a K3.1
    indexer (every op may run in a K3.1 model: its DSA layers take the dense path only for short documents),
    and the indexer's distillation unless it trains."""
    unused = set() if args.has_indexer else {"indexer_topk", "sparse_mla"}
    return unused if args.indexer_trains else unused | {"indexer_distillation"}


def configure_kernels(kernels: Any, args: Any) -> dict[str, Any]:
    """Validates and applies the section (nothing changes if a backend cannot run here); returns
    ``{op: resolved backend, setting: value}`` for the log line. Ops the model of ``args`` never calls keep
    ``auto`` unresolved (``unused_ops``): no availability check, no library imported for them."""
    refuse_replaced_environment(os.environ)
    resolved: dict[str, Any] = configure_backends({op: getattr(kernels, op) for op in BACKEND_OPS},
                                                  unused_ops(args))
    settings = configure_kernel_settings(**{name: getattr(kernels, name) for name in SETTINGS})
    resolved.update({name: getattr(settings, name) for name in SETTINGS})
    return resolved


def check_routed_expert_gemm(precision: str, device: Any) -> None:
    """``training.routed_expert_gemm``: a ValueError, before the model is built, when it cannot run on ``device``
    (importing torchao here also keeps its pytree registrations out of the first compiled step)."""
    from lowerings.ops.expert_gemm import fp8_unavailable_reason

    if precision == "fp8_rowwise" and (reason := fp8_unavailable_reason(device)) is not None:
        raise ValueError(f"training.routed_expert_gemm = 'fp8_rowwise' cannot run here: {reason}; valid here: "
                         "'default'")


def describe(resolved: dict[str, Any]) -> str:
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in resolved.items())


# The libraries behind backends that import lazily, at their first call: (modules, packages whose __init__ may
# wait, optional dependencies imported as if absent); see lowerings/kernels/quick_imports.py for why.
_BACKEND_MODULES = {
    ("kda", "fla"): (FLA_MODULES, FLA_DEFERRED_PACKAGES, ()),
    ("linear_cross_entropy", "liger"): (("liger_kernel.ops.fused_linear_cross_entropy",), (), ("peft",)),
}


def import_backend_libraries(resolved: dict[str, Any]) -> list[str]:
    """Import the chosen backends' libraries before the first step (after FLA's configs are prepared, which FLA
    reads at import). Imported inside the first step, a library that registers pytree nodes changes a guard of
    every graph compiled before it, and Dynamo compiles those again at step 2. Only the modules the backends
    call are imported (their libraries' package ``__init__`` and unused optional dependencies wait until someone
    asks for them). Returns the modules imported."""
    from lowerings.kernels.quick_imports import quick_import

    names = []
    for (op, backend), (modules, defer, without) in _BACKEND_MODULES.items():
        if resolved.get(op) == backend:
            for name in modules:
                quick_import(name, defer=defer, without=without)
                names.append(name)
    return names
