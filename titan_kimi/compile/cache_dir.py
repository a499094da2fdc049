"""``compile.cache_dir``: where Inductor and Triton keep what they compiled, so it can outlive the machine.

torch.compile's graphs (Inductor's FX-graph and AOT-autograd caches, their Triton kernels) and the Triton JIT
kernels of FLA, liger and lowerings/kernels are cached on disk, by default under /tmp: a fresh machine or
container starts from nothing and the first step compiles everything again (about 65 s of the k3_small recipe's
first step on the H200, docs/perf.md). Pointed at persistent storage (next to the checkpoints, a shared file
system), a restart or another node loads them instead (on the H200, a first step that found every graph cached
took 8 s). Both caches key their entries by what was compiled (graph, shapes, torch / Triton versions, GPU), so
a changed model or another GPU only misses; their writes are atomic renames, so ranks and runs may share one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("titan_kimi")

ENV = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}


def use_compile_cache_dir(cache_dir: str) -> dict[str, str]:
    """Point Inductor's and Triton's caches at ``cache_dir``/inductor and ``cache_dir``/triton (through their
    environment variables, which they read when they next compile, and which helper processes inherit); the
    settings made, empty for ``""``. Raises ValueError naming the path when it cannot be created or written."""
    if not cache_dir:
        return {}
    root = Path(cache_dir).expanduser().resolve()
    made = {}
    for sub, variable in ENV.items():
        path = root / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"compile.cache_dir = {cache_dir!r}: cannot create {path} ({err.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"compile.cache_dir = {cache_dir!r}: {path} is not writable")
        previous = os.environ.get(variable)
        if previous is not None and Path(previous).resolve() != path:
            logger.info("compile.cache_dir replaces %s=%s", variable, previous)
        os.environ[variable] = made[variable] = str(path)
    return made
