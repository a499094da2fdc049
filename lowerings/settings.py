"""Kernel settings that change how the fused kernels run (never what they compute): set from the ``[kernels]``
config section by titan_kimi.train, or by a script's flags; environment variables do not switch them.

Imports nothing heavy; the kernels read the current values when they launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

FLA_CONFIG_CHOICES = ("shipped", "autotune")


@dataclass(frozen=True)
class KernelSettings:
    triton_autotune: bool = True  # autotune the Triton kernels of lowerings/kernels on a GPU (else default configs)
    sparse_mla_ws: bool = True  # on Hopper, the warp-specialized Gluon sparse-MLA forward (else the Triton one)
    fla_configs: str = "shipped"  # shipped: FLA reads the configs tuned for this GPU; autotune: FLA tunes itself


_current = KernelSettings()


def kernel_settings() -> KernelSettings:
    return _current


def configure_kernel_settings(**changes: Any) -> KernelSettings:
    """Replace some settings (``triton_autotune=False``, ...); a ValueError names an unknown one or a bad value."""
    global _current
    known = {f.name: f.type for f in dataclasses.fields(KernelSettings)}
    for name, value in changes.items():
        if name not in known:
            raise ValueError(f"kernel setting {name!r} is unknown; valid: {sorted(known)}")
        if name == "fla_configs" and value not in FLA_CONFIG_CHOICES:
            raise ValueError(f"kernels.fla_configs = {value!r} is invalid; valid: {list(FLA_CONFIG_CHOICES)}")
        if name != "fla_configs" and not isinstance(value, bool):
            raise ValueError(f"kernels.{name} = {value!r} must be true or false")
    _current = dataclasses.replace(_current, **changes)
    return _current


# Environment variables that used to switch these settings: set, they are refused rather than silently ignored.
REPLACED_ENVIRONMENT = {
    "TITAN_KIMI_TRITON_AUTOTUNE": "kernels.triton_autotune (--kernels.triton_autotune false for =0)",
    "TITAN_KIMI_SPARSE_MLA_WS": "kernels.sparse_mla_ws (--kernels.sparse_mla_ws false for =0)",
}


def refuse_replaced_environment(environ: Mapping[str, str]) -> None:
    """ValueError naming any set variable of REPLACED_ENVIRONMENT and the config key that replaced it."""
    found = [f"{name}={environ[name]!r} -> {key}" for name, key in REPLACED_ENVIRONMENT.items() if name in environ]
    if found:
        raise ValueError("environment variables no longer read (kernel settings are [kernels] config keys, printed "
                         "with the resolved config); unset them and use the keys: " + "; ".join(found))
