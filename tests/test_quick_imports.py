"""lowerings/kernels/quick_imports.py: a backend's modules import without their packages' __init__ and without
unused optional dependencies, and nothing is lost (the __init__ runs at the first name read from it; the
optional dependency imports normally afterwards). Each case runs in a fresh interpreter: sys.modules is the
state under test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, tmp_path: Path) -> str:
    """Run ``code`` in a new interpreter with ``tmp_path`` (the fake libraries) and the repo on the path."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def library(tmp_path: Path) -> Path:
    """``lib``: a package whose ``ops`` __init__ imports a heavy sibling and defines a name; ``lib.ops.kda``
    imports ``lib.ops.utils`` and an optional dependency ``extra`` (installed here)."""
    files = {
        "lib/__init__.py": "",
        "lib/ops/__init__.py": "from . import heavy\nfrom .kda import kda\nEXPORTED = 'from ops __init__'\n",
        "lib/ops/heavy.py": "import builtins\nbuiltins.HEAVY_IMPORTED = True\n",
        "lib/ops/utils.py": "def helper():\n    return 3\n",
        "lib/ops/kda/__init__.py": "from .chunk import kda\n",
        "lib/ops/kda/chunk.py": textwrap.dedent("""
            from lib.ops.utils import helper
            try:
                import extra
                HAS_EXTRA = True
            except ImportError:
                HAS_EXTRA = False
            def kda():
                return helper()
        """),
        "extra/__init__.py": "VALUE = 7\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_module_imports_without_the_package_init(library):
    out = run("""
        import builtins, sys
        from lowerings.kernels.quick_imports import quick_import
        chunk = quick_import("lib.ops.kda.chunk", defer=("lib.ops",), without=("extra",))
        print(chunk.kda(), chunk.HAS_EXTRA, hasattr(builtins, "HEAVY_IMPORTED"), "extra" in sys.modules)
        import extra  # importable again
        print(extra.VALUE, hasattr(builtins, "HEAVY_IMPORTED"))
        from lib.ops import EXPORTED  # a name of the deferred __init__: it runs now
        print(EXPORTED, hasattr(builtins, "HEAVY_IMPORTED"))
        import lib.ops
        print(lib.ops.kda.__name__ if hasattr(lib.ops.kda, "__name__") else lib.ops.kda)
    """, library).split("\n")
    assert out[0] == "3 False False False"
    assert out[1] == "7 False"
    assert out[2] == "from ops __init__ True"


def test_an_imported_package_is_left_alone(library):
    out = run("""
        import builtins
        import lib.ops
        from lowerings.kernels.quick_imports import DeferredPackage, quick_import
        quick_import("lib.ops.kda.chunk", defer=("lib.ops",))
        print(type(lib.ops) is not DeferredPackage, builtins.HEAVY_IMPORTED)
    """, library)
    assert out.strip() == "True True"


def test_a_missing_name_still_raises(library):
    out = run("""
        from lowerings.kernels.quick_imports import quick_import
        quick_import("lib.ops.utils", defer=("lib.ops",))
        import lib.ops
        try:
            lib.ops.not_there
        except AttributeError as err:
            print("AttributeError:", err)
        print(lib.ops.EXPORTED)
    """, library).split("\n")
    assert out[0] == "AttributeError: module 'lib.ops' has no attribute 'not_there'"
    assert out[1] == "from ops __init__"


def test_fla_kda_imports_without_fla_ops_init():
    """The real library: FLA's KDA modules (CPU: importable, the kernels never launch) without fla.ops' op
    families, and fla.ops' exports still reachable afterwards."""
    pytest.importorskip("fla")
    out = run("""
        import sys
        from titan_kimi.training.setup.kernels import import_backend_libraries
        names = import_backend_libraries({"kda": "fla"})
        print(len(names), "fla.ops.abc" in sys.modules, "fla.ops.kda.chunk_fwd" in sys.modules)
        from fla.ops import chunk_abc
        print(callable(chunk_abc), "fla.ops.abc" in sys.modules)
    """, ROOT).split("\n")
    assert out[0] == "4 False True"
    assert out[1] == "True True"
