"""Import the few modules a backend calls without the rest of its library: seconds off every run's start-up.

FLA's ``fla.ops`` and ``fla.modules`` packages import every op family they ship when imported (about 4 s on
the H200 machine, of which KDA needs a fraction), and liger-kernel imports ``peft`` (and through it
``transformers``, 4.4 s there) only to set a flag its LoRA helpers read. Measured with ``python -X importtime``
(docs/perf.md).

:func:`quick_import` imports a module

- while the named packages' ``__init__`` waits: each package is entered in ``sys.modules`` as a
  :class:`DeferredPackage` whose submodules import as usual, and whose own ``__init__`` runs the first time anyone
  reads a name it would have defined. Nothing is lost: ``from fla.ops import chunk_gla`` later still works, it
  only pays the import then;
- while the named optional dependencies look uninstalled; they are importable again afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Iterable, Iterator


class DeferredPackage(types.ModuleType):
    """A package entered in ``sys.modules`` before its ``__init__`` ran: the first read of a name the module does
    not have runs the ``__init__`` (in this module's namespace, as an import would) and then returns the name."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # import machinery probing dunders: nothing to run
            raise AttributeError(name)
        code = self.__dict__.pop("_deferred_init", None)
        if code is not None:
            exec(code, self.__dict__)
            if name in self.__dict__:
                return self.__dict__[name]
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def _defer(package: str) -> None:
    if package in sys.modules:  # already imported (or deferred): nothing to save
        return
    spec = importlib.util.find_spec(package)  # imports the parent package, not this one
    if spec is None or spec.submodule_search_locations is None or spec.loader is None:
        raise ValueError(f"{package!r} is not an importable package")
    module = DeferredPackage(package)
    module.__spec__, module.__file__, module.__package__ = spec, spec.origin, package
    module.__path__ = list(spec.submodule_search_locations)
    module.__loader__ = spec.loader
    module.__dict__["_deferred_init"] = spec.loader.get_code(package)
    sys.modules[package] = module
    parent, _, child = package.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


@contextmanager
def _absent(names: Iterable[str]) -> Iterator[None]:
    blocked = [n for n in names if n not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # `import name` raises ImportError, as if it were not installed
    try:
        yield
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def quick_import(module: str, defer: Iterable[str] = (), without: Iterable[str] = ()) -> types.ModuleType:
    """Import ``module`` with each package of ``defer`` (outermost first) entered as a :class:`DeferredPackage`,
    and the optional dependencies ``without`` (those not imported yet) looking uninstalled meanwhile; they are
    importable again afterwards."""
    for package in defer:
        _defer(package)
    with _absent(without):
        return importlib.import_module(module)
