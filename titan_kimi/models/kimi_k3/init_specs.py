"""The initial distribution of every parameter, by name, as data (spec §14): the one description of the
initialisation. Each module declares its own parameters' distributions (``parameter_init_specs() -> {relative
name: InitSpec}``; a plain ``nn.Linear`` has N(0, init_std)). Two initialisers draw from it: the modules'
``init_weights`` (``init_declared``, one global random stream, in declaration order) and
titan_kimi/training/setup/seeded_init.py (each parameter from its own seed, whatever the parallel layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# Wrappers that insert a level into names: activation checkpointing and torch.compile.
_WRAPPER_LEVELS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class InitSpec:
    """``normal(0, std)``, ``trunc_normal(0, std)`` cut at ``[low, high]``, ``uniform(low, high)``,
    ``log_uniform`` (the log of ``uniform(low, high)``) or ``constant(value)``; ``zero_rows`` are zeroed."""

    kind: str
    std: float = 0.0
    low: float = 0.0
    high: float = 0.0
    value: float = 0.0
    zero_rows: tuple[int, ...] = ()

    @property
    def random(self) -> bool:
        return self.kind != "constant"


def canonical_name(fqn: str) -> str:
    for level in _WRAPPER_LEVELS:
        fqn = fqn.replace(level, "")
    return fqn


def _module_rule(module: nn.Module, name: str, std: float) -> InitSpec | None:
    """The spec of ``module``'s own parameter ``name``: what the module declares, else N(0, ``std``) for the
    weight of a plain ``nn.Linear``; None when neither covers it."""
    declared = getattr(module, "parameter_init_specs", None)
    spec = declared().get(name) if callable(declared) else None
    if spec is None and isinstance(module, nn.Linear) and name == "weight":
        spec = InitSpec("normal", std=std)
    return spec


def draw_(tensor: torch.Tensor, spec: InitSpec, generator: torch.Generator | None = None, row0: int = 0) -> None:
    """Fill ``tensor`` (rows ``row0..`` of the parameter) from ``spec``, in place."""
    with torch.no_grad():
        if spec.kind == "constant":
            tensor.fill_(spec.value)
        elif spec.kind == "normal":
            tensor.normal_(0.0, spec.std, generator=generator)
        elif spec.kind == "trunc_normal":
            nn.init.trunc_normal_(tensor, 0.0, spec.std, spec.low, spec.high, generator=generator)
        elif spec.kind == "uniform":
            tensor.uniform_(spec.low, spec.high, generator=generator)
        elif spec.kind == "log_uniform":
            tensor.uniform_(spec.low, spec.high, generator=generator).log_()
        else:
            raise ValueError(f"unknown init kind {spec.kind!r}; valid: constant, normal, trunc_normal, uniform, "
                             f"log_uniform")
        for row in spec.zero_rows:
            if tensor.dim() and row0 <= row < row0 + tensor.shape[0]:
                tensor[row - row0].zero_()


def init_declared(module: nn.Module, specs: dict[str, InitSpec] | None = None) -> None:
    """Draw ``specs`` (default: all that ``module`` declares, ``parameter_init_specs``) of ``module``'s
    parameters from the global random stream, in order."""
    for name, spec in (module.parameter_init_specs() if specs is None else specs).items():
        draw_(module.get_parameter(name), spec)


def init_linear(linear: nn.Linear, std: float) -> None:
    """A plain ``nn.Linear``'s weight from the global random stream (its bias, if any, is the owner's)."""
    draw_(linear.weight, _module_rule(linear, "weight", std))


def init_specs(model: nn.Module) -> dict[str, InitSpec]:
    """``{canonical parameter name: InitSpec}`` for every parameter of a Kimi K3 model (whole, a pipeline stage,
    or wrapped for parallelism); a ValueError names a parameter no module declares.

    A module's ``parameter_init_specs`` may name its children's parameters too (the model its embedding, the
    vision tower and the projector all of theirs, a LoRA adapter its factors)."""
    args = model.args
    specs: dict[str, InitSpec] = {}
    unknown: list[str] = []
    declared: dict[str, InitSpec] = {}
    for module_name, module in model.named_modules():
        own = getattr(module, "parameter_init_specs", None)
        if callable(own):
            for rel, spec in own().items():
                declared[canonical_name(f"{module_name}.{rel}" if module_name else rel)] = spec
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            fqn = canonical_name(f"{module_name}.{name}" if module_name else name)
            spec = declared[fqn] if fqn in declared else _module_rule(module, name, args.init_std)
            if spec is None:
                unknown.append(f"{fqn} ({type(module).__name__}.{name})")
            else:
                specs[fqn] = spec
    if unknown:
        raise ValueError(f"no initial distribution for {unknown}; declare it in the module's "
                         f"parameter_init_specs (titan_kimi/models/kimi_k3/init_specs.py)")
    return specs
