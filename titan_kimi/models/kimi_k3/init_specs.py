"""The initial distribution of every parameter, by name, as data: what each module's ``init_weights`` draws
(spec §14), for an initialiser that draws each parameter from its own seed (titan_kimi/training/seeded_init.py)
instead of one global random stream.

Keep in step with the modules' ``init_weights``; tests/test_seeded_init.py compares the two distributions for
every parameter of the debug flavors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from titan_kimi.models.kimi_k3.attn_res import AttnResMix
from titan_kimi.models.kimi_k3.delta_attention import DecayParams
from titan_kimi.models.kimi_k3.moe import GroupedExperts, Router
from titan_kimi.models.kimi_k3.norms import FP32LayerNorm, GatedRMSNorm, RMSNorm
from titan_kimi.models.kimi_k3.short_conv import ShortConv

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


def _constant(value: float) -> InitSpec:
    return InitSpec("constant", value=value)


def canonical_name(fqn: str) -> str:
    for level in _WRAPPER_LEVELS:
        fqn = fqn.replace(level, "")
    return fqn


def _module_rule(module: nn.Module, name: str, std: float) -> InitSpec | None:
    """The spec of ``module``'s own parameter ``name``; None when no rule covers it."""
    if isinstance(module, (RMSNorm, GatedRMSNorm)) and name == "weight":
        return _constant(1.0)
    if isinstance(module, FP32LayerNorm):  # reset_parameters: weight 1, bias 0
        return {"weight": _constant(1.0), "bias": _constant(0.0)}.get(name)
    if isinstance(module, ShortConv) and name == "weight":  # PyTorch's Conv1d default, U(+-1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(module.kernel_size)
        return InitSpec("uniform", low=-bound, high=bound)
    if isinstance(module, DecayParams):
        return {"A_log": InitSpec("log_uniform", low=1.0, high=16.0), "dt_bias": _constant(0.0)}.get(name)
    if isinstance(module, AttnResMix):
        return {"norm_weight": _constant(1.0), "proj_weight": InitSpec("normal", std=std)}.get(name)
    if isinstance(module, Router) and name == "e_score_correction_bias":
        return _constant(0.0)
    if isinstance(module, GroupedExperts) and name in ("w13", "w2"):
        return InitSpec("normal", std=std)
    if isinstance(module, nn.Linear) and name == "weight":
        return InitSpec("normal", std=std)
    return None


def init_specs(model: nn.Module) -> dict[str, InitSpec]:
    """``{canonical parameter name: InitSpec}`` for every parameter of a Kimi K3 model (whole, a pipeline stage,
    or wrapped for parallelism); a ValueError names a parameter no rule covers.

    A module may describe its own parameters (and its children's) with ``parameter_init_specs() -> {relative
    name: InitSpec}`` (the vision tower, the projector, LoRA adapters); those take precedence over the rules."""
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
        for name, param in module.named_parameters(recurse=False):
            fqn = canonical_name(f"{module_name}.{name}" if module_name else name)
            if fqn in declared:
                spec = declared[fqn]
            elif fqn == "tok_embeddings.weight":
                spec = InitSpec("normal", std=args.init_std, zero_rows=(args.pad_token_id,))
            elif fqn == "output.weight":  # the lm_head: truncated normal, std H^-1/2, cut at 3 std
                std = 1.0 / math.sqrt(param.shape[1])
                spec = InitSpec("trunc_normal", std=std, low=-3 * std, high=3 * std)
            else:
                spec = _module_rule(module, name, args.init_std)
            if spec is None:
                unknown.append(f"{fqn} ({type(module).__name__}.{name})")
            else:
                specs[fqn] = spec
    if unknown:
        raise ValueError(f"no initial distribution for {unknown}; add a rule to "
                         f"titan_kimi/models/kimi_k3/init_specs.py matching the module's init_weights")
    return specs
