"""Backend registry: which implementation each op runs.

Every op has a reference backend (pure PyTorch, runs anywhere; named ``reference`` unless the catalog says
otherwise). Fused backends register an availability
check; selecting one that is unavailable fails at config validation with the reason, never mid-step.
``auto`` picks the first available backend of the op's preference order and logs the choice.

What each op runs is one immutable ``ResolvedBackends``, decided by ``configure_backends`` and replaced as a
whole (never edited); ops read it through ``selected_backend``, so a compiled graph guards on the choice it was
traced under and a new choice recompiles.

The compile mode also sets, for the span of a compiled call, how ops lower under tracing: Inductor-visible
``triton_op`` variants instead of the opaque custom ops, or an op's plain formula for a graph pass to match
(``compile_lowering``). Eager code is unaffected.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping

from lowerings.catalog import BACKEND_OPS

logger = logging.getLogger(__name__)

AvailabilityCheck = Callable[[], "str | None"]  # None when available, else the reason it is not


def always_available() -> str | None:
    return None


@dataclass
class OpBackends:
    """The backends of one op: name -> availability check, plus the ``auto`` preference order."""

    op: str
    checks: dict[str, AvailabilityCheck] = field(default_factory=dict)
    auto_order: list[str] = field(default_factory=list)
    auto_checks: dict[str, AvailabilityCheck] = field(default_factory=dict)

    def add(self, name: str, check: AvailabilityCheck = always_available, *, auto_rank: int | None = None,
            auto_check: AvailabilityCheck | None = None) -> None:
        """``check``: whether the backend can run here; ``auto_check``: a further condition for ``auto`` to take
        it (a backend that runs anywhere but is only the fastest on some devices)."""
        if name not in BACKEND_OPS[self.op].backends:  # the catalog is the one list the config is built from
            raise ValueError(f"backend {name!r} of op {self.op!r} is not listed in lowerings/catalog.py; "
                             f"listed: {list(BACKEND_OPS[self.op].backends)}")
        self.checks[name] = check
        if auto_check is not None:
            self.auto_checks[name] = auto_check
        if auto_rank is not None:
            self.auto_order.insert(min(auto_rank, len(self.auto_order)), name)

    def resolve_auto(self) -> tuple[str, dict[str, str]]:
        """The first available backend of the preference order, and why each one before it was skipped."""
        skipped = {}
        for candidate in self.auto_order:
            reason = self.checks[candidate]() or self.auto_checks.get(candidate, always_available)()
            if reason is None:
                return candidate, skipped
            skipped[candidate] = reason
        return BACKEND_OPS[self.op].reference, skipped

    def choices(self) -> list[str]:
        return ["auto", *BACKEND_OPS[self.op].backends]

    def resolve(self, name: str) -> str:
        """Return the concrete backend for ``name`` or raise ValueError saying why it cannot run here."""
        if name == "auto":
            return self.resolve_auto()[0]
        if name not in self.checks:
            raise ValueError(f"kernels.{self.op} = {name!r} is not a backend of {self.op}; valid: {self.choices()}")
        reason = self.checks[name]()
        if reason is not None:
            raise ValueError(f"kernels.{self.op} = {name!r} is not available on this machine: {reason}")
        return name


@dataclass(frozen=True)
class ResolvedBackends:
    """The backend every op of lowerings/catalog.py runs (ops left out run their reference backend)."""

    choices: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, name in self.choices.items():
            if op not in BACKEND_OPS or name not in BACKEND_OPS[op].backends:
                valid = list(BACKEND_OPS[op].backends) if op in BACKEND_OPS else list(BACKEND_OPS)
                raise ValueError(f"ResolvedBackends: {op} = {name!r} is not a backend in lowerings/catalog.py; "
                                 f"valid: {valid}")
        full = {op: self.choices.get(op, entry.reference) for op, entry in BACKEND_OPS.items()}
        object.__setattr__(self, "choices", MappingProxyType(full))

    def replaced(self, updates: Mapping[str, str]) -> "ResolvedBackends":
        """A new choice with ``updates`` (``{op: backend}``) over this one's."""
        return ResolvedBackends({**self.choices, **updates})


_REGISTRY: dict[str, OpBackends] = {}
_RESOLVED = ResolvedBackends()  # every op on its reference backend until configure_backends runs


def op_backends(op: str) -> OpBackends:
    if op not in BACKEND_OPS:
        raise ValueError(f"op {op!r} is not listed in lowerings/catalog.py; listed: {list(BACKEND_OPS)}")
    if op not in _REGISTRY:
        backends = OpBackends(op)
        backends.add(BACKEND_OPS[op].reference)
        _REGISTRY[op] = backends
    return _REGISTRY[op]


def selected_backend(op: str) -> str:
    """The backend ``op`` runs: a read of the current ``ResolvedBackends`` (Dynamo guards on it)."""
    return _RESOLVED.choices[op]


def resolved_backends() -> ResolvedBackends:
    return _RESOLVED


def install_backends(resolved: ResolvedBackends) -> None:
    """Make ``resolved`` the choice every op reads, unchecked: one ``configure_backends`` or
    ``resolved_backends`` returned earlier (to restore it), or one built by hand where a test stands in for a
    machine that has the backend."""
    global _RESOLVED
    if not isinstance(resolved, ResolvedBackends):
        raise ValueError(f"install_backends takes a ResolvedBackends, got {type(resolved).__name__}")
    _RESOLVED = resolved


def known_ops() -> list[str]:
    return sorted(_REGISTRY)


def configure_backends(choices: Mapping[str, str], unused: Iterable[str] = ()) -> dict[str, str]:
    """Validate and apply ``{op: backend}`` (the ``[kernels]`` section); returns the resolved choices.

    All choices are checked before any is applied, so a bad config changes nothing; the ops left out keep the
    backend they had. ``unused``: ops the model never calls; left at ``auto`` they take their reference backend
    without checking the others (an availability check can import a large library, e.g. cuDNN's CuTe-DSL
    runtime: seconds of start-up for nothing), while a named backend is still checked.
    """
    unused = set(unused)
    resolved = {}
    for op, name in choices.items():
        if op not in _REGISTRY:
            raise ValueError(f"kernels.{op}: unknown op; valid ops: {known_ops()}")
        if name == "auto" and op in unused:
            resolved[op] = BACKEND_OPS[op].reference
            continue
        resolved[op] = _REGISTRY[op].resolve(name)
    install_backends(_RESOLVED.replaced(resolved))
    for op, name in resolved.items():
        if choices[op] == "auto" and op in unused:
            logger.info("kernels.%s = auto: not used by this model", op)
        elif choices[op] == "auto":
            skipped = _REGISTRY[op].resolve_auto()[1]
            because = "; ".join(f"{k}: {v}" for k, v in skipped.items())
            logger.info("kernels.%s = auto -> %s%s", op, name, f" (skipped {because})" if because else "")
    return resolved


# ---------------------------------------------------------------- planning without a GPU
_PLAN_AS_CUDA: bool = False


def planned_backends(choices: Mapping[str, str]) -> ResolvedBackends:
    """What ``choices`` (``{op: backend or auto}``, the ``[kernels]`` section) resolve to on a CUDA machine that
    has every backend, without checking any: a named backend stays, ``auto`` takes the first of the op's
    preference order. For planning (memory estimates) where the job's GPUs are not."""
    planned = {}
    for op, name in choices.items():
        backends = op_backends(op)
        if name != "auto" and name not in backends.checks:
            raise ValueError(f"kernels.{op} = {name!r} is not a backend of {op}; valid: {backends.choices()}")
        planned[op] = name if name != "auto" else (backends.auto_order or [BACKEND_OPS[op].reference])[0]
    return ResolvedBackends(planned)


@contextmanager
def plan_as_cuda(resolved: ResolvedBackends) -> Iterator[None]:
    """For fake-tensor planning (memory estimates) on a machine without a GPU: while active, ops take the CUDA
    paths of the backends in ``resolved`` (e.g. ``planned_backends``; not checked for availability) for CPU
    tensors, so that their fake implementations report what those kernels return and keep for backward. Their
    bodies must never run: use it under ``FakeTensorMode`` only."""
    global _PLAN_AS_CUDA
    saved = _PLAN_AS_CUDA, _RESOLVED
    _PLAN_AS_CUDA = True
    install_backends(resolved)
    try:
        yield
    finally:
        _PLAN_AS_CUDA = saved[0]
        install_backends(saved[1])


def on_cuda(t) -> bool:
    """Whether ``t`` takes the CUDA kernels (it is a CUDA tensor, or plan_as_cuda is active)."""
    return t.is_cuda or _PLAN_AS_CUDA


def cuda_available() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def module_available(module: str) -> AvailabilityCheck:
    def check() -> str | None:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            return f"python module {module!r} is not installed"
        return None

    return check


def all_of(*checks: AvailabilityCheck) -> AvailabilityCheck:
    def check() -> str | None:
        for c in checks:
            reason = c()
            if reason is not None:
                return reason
        return None

    return check


# ---------------------------------------------------------------- how ops lower while torch.compile traces
# Set only for the duration of a compiled call by the compile mode (lowerings.inductor.modes); eager code
# always runs the opaque custom ops. Plain module globals (a bool and a tuple of str) so that Dynamo guards
# on their values: a change recompiles instead of reusing a graph traced under other settings.
_TRITON_OPS: bool = False
_DECOMPOSED: tuple[str, ...] = ()


def triton_ops_enabled() -> bool:
    """Under compile, use the Inductor-visible ``torch.library.triton_op`` variants where they exist."""
    return _TRITON_OPS


def emits_formula(op: str) -> bool:
    """Under compile, emit ``op`` as its plain-torch formula for a graph pass to rewrite into the fused op."""
    return op in _DECOMPOSED


@contextmanager
def compile_lowering(*, triton_ops: bool, decomposed: Iterable[str] = ()) -> Iterator[None]:
    """Scope the lowering flags above (nests; restores the previous values on exit)."""
    global _TRITON_OPS, _DECOMPOSED
    unknown = sorted(set(decomposed) - set(_REGISTRY))
    if unknown:
        raise ValueError(f"compile_lowering: decomposed ops {unknown} are not registered; valid: {known_ops()}")
    saved = _TRITON_OPS, _DECOMPOSED
    _TRITON_OPS, _DECOMPOSED = triton_ops, tuple(sorted(decomposed))
    try:
        yield
    finally:
        _TRITON_OPS, _DECOMPOSED = saved
