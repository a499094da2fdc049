"""Shipped FLA (fla-core 0.6.0) Triton autotune configs: choosing them before FLA loads, and dumping new ones.

FLA's kernels are wrapped in ``fla.ops.utils.cache.CachedAutotuner``, which, before Triton autotunes a new key,
looks in ``$FLA_CONFIG_DIR/{kernel_name}.json`` for a tuned config. ``FLA_CACHE_MODE`` decides how (FLA's
default is ``disabled``: always autotune, which costs minutes at the first training step). FLA reads
``FLA_CACHE_MODE`` once, when ``fla`` is imported, so :func:`use_shipped_fla_configs` must run before that;
``lowerings/kernels/fla_kda.py`` calls it at import, and that module imports ``fla`` only inside its functions.

Configs live in ``lowerings/kernels/fla_configs/<GPU name>/`` (the name sanitised like FLA's
``sanitize_gpu_name``) and are produced on that GPU by ``scripts/tools/tune_fla_configs.py`` (see docs/ops.md).
This module never imports ``fla`` itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).resolve().parent / "fla_configs"
SHIPPED_MODE = "fuzzy"  # exact key first, then any key of the same structure; FLA autotunes what has no entry
_ENV_MODE, _ENV_DIR = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"
_SCALARS = (bool, int, float, str, type(None))


def sanitize_gpu_name(gpu_name: str) -> str:
    """Exactly FLA's ``fla.ops.utils.cache.sanitize_gpu_name`` ("NVIDIA H200" -> "NVIDIA_H200")."""
    sanitized = re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_")
    return sanitized or "unknown_gpu"


def current_gpu_name() -> str | None:
    """The GPU FLA would name: ``FLA_GPU_NAME`` if set (FLA's own override), else CUDA device 0; None without one."""
    if os.environ.get("FLA_GPU_NAME"):
        return os.environ["FLA_GPU_NAME"]
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # a broken driver must not break importing the adapter; FLA then just autotunes
        logger.warning("could not read the CUDA device name (%s); no shipped FLA configs", e)
        return None


def shipped_config_dir(gpu_name: str | None = None) -> Path | None:
    """``fla_configs/<sanitised gpu_name>`` (default: the current GPU) if it exists and holds a ``*.json``."""
    if gpu_name is None:
        gpu_name = current_gpu_name()
        if gpu_name is None:
            return None
    path = CONFIG_ROOT / sanitize_gpu_name(gpu_name)
    if path.is_dir() and any(path.glob("*.json")):
        return path
    return None


def use_shipped_fla_configs(mode: str = SHIPPED_MODE) -> str:
    """Point FLA at the configs shipped for this GPU, unless the user chose; returns a one-line description.

    Sets ``FLA_CONFIG_DIR`` and ``FLA_CACHE_MODE=mode`` (training: ``fuzzy``; the GPU tests without autotuning:
    ``full``, FLA's defaults for shapes without an entry) only when neither is set by the user, a shipped
    directory exists for the GPU, and ``fla`` has not been imported yet (FLA reads the mode at import; setting
    it afterwards would not take effect, and the description says so). Never raises.
    """
    user = {name: os.environ[name] for name in (_ENV_MODE, _ENV_DIR) if name in os.environ}
    if user:
        settings = ", ".join(f"{name}={value}" for name, value in user.items())
        return f"fla configs: user {settings}"
    gpu = current_gpu_name()
    if gpu is None:
        return "fla configs: no CUDA device, FLA autotunes"
    path = shipped_config_dir(gpu)
    if path is None:
        return f"fla configs: none shipped for {sanitize_gpu_name(gpu)}, FLA autotunes"
    if "fla" in sys.modules:
        return (f"fla configs: shipped {path.name} NOT used: fla was imported before titan_kimi could set "
                f"{_ENV_MODE} (FLA autotunes); export {_ENV_MODE}={mode} {_ENV_DIR}={path} to use them")
    os.environ[_ENV_DIR] = str(path)
    os.environ[_ENV_MODE] = mode
    return f"fla configs: shipped {path.name} ({mode})"


# ------------------------------------------------------------------------------------------------- dumping
def _is_json_clean(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_json_clean(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _SCALARS)


def _key_hash(key: Any) -> str:
    """FLA's ``AutotuneKey.key_hash`` (md5 of compact, key-sorted JSON; tuples serialise as lists)."""
    import hashlib

    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _config_dict(config: Any) -> dict[str, Any]:
    """A ``triton.Config`` in FLA's json layout."""
    out = {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": getattr(config, "num_ctas", 1),
        "maxnreg": getattr(config, "maxnreg", None),
    }
    if getattr(config, "ir_override", None) is not None:  # FLA passes it through when present
        out["ir_override"] = config.ir_override
    return out


def _key_size(entry: dict[str, Any]) -> float:
    numbers = [v for v in _leaves(entry.get("autotune_key")) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return math.prod(numbers) if numbers else 0


def _leaves(value: Any):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _default_config(entries: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    # FLA uses default_config only in its full/default/always modes, for a key with no exact or same-structure
    # entry, so any choice is a guess. We take the entry whose key has the largest product of numeric values
    # (the largest problem tuned: where a config's speed matters most), ties to the later entry; unlike "the
    # most recently added entry" this does not depend on the order shapes were tuned or files merged.
    best = None
    for entry in entries.values():
        if best is None or _key_size(entry) >= _key_size(best):
            best = entry
    return None if best is None else best["config"]


def _autotuners_in(obj: Any, KernelInterface: type, Autotuner: type):
    """Autotuners reachable from a module attribute through ``.fn`` (``@triton.heuristics`` wraps them)."""
    for _ in range(8):
        if not isinstance(obj, KernelInterface):
            return
        if isinstance(obj, Autotuner):
            yield obj
        obj = getattr(obj, "fn", None)


def find_fla_autotuners() -> list[Any]:
    """FLA's config-reading autotuners (``CachedAutotuner``: a Triton ``Autotuner`` with a ``kernel_name``) in
    the loaded ``fla.*`` modules, deduplicated. Plain ``triton.autotune`` kernels are skipped: FLA never
    reads configs for them."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            for tuner in _autotuners_in(value, KernelInterface, Autotuner):
                if isinstance(getattr(tuner, "kernel_name", None), str):
                    found.setdefault(id(tuner), tuner)
    return list(found.values())


def collect_fla_entries() -> dict[str, dict[str, dict[str, Any]]]:
    """``{kernel_name: {key hash: {"autotune_key": [...], "config": {...}}}}`` of every tuned key in memory."""
    cache_module = sys.modules.get("fla.ops.utils.cache")
    mode = getattr(getattr(cache_module, "FLA_CACHE_MODE", None), "value", "disabled")
    if mode != "disabled":
        logger.warning("FLA_CACHE_MODE=%s: entries loaded from existing config files (fuzzy matches included) are "
                       "dumped as if tuned; tune with FLA_CACHE_MODE=disabled", mode)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for tuner in find_fla_autotuners():
        for key, config in dict(tuner.cache).items():
            entry = {"autotune_key": list(key), "config": _config_dict(config)}
            if not _is_json_clean(entry["autotune_key"]) or not _is_json_clean(list(entry["config"]["kwargs"].values())):
                logger.warning("skipping %s key %r: not JSON-clean (FLA could not look it up either)",
                               tuner.kernel_name, key)
                continue
            out.setdefault(tuner.kernel_name, {})[_key_hash(entry["autotune_key"])] = entry
    return out


def _read_existing(path: Path, kernel_name: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot merge into an unreadable FLA config file ({e}); move it away") from e
    entries = data.get("autotune_entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and isinstance(e.get("config"), dict)
                                                for e in entries.values()):
        raise ValueError(f"{path}: not an FLA config file with 'autotune_entries'; move it away")
    if data.get("kernel_name") not in (None, kernel_name):
        raise ValueError(f"{path}: holds kernel_name {data['kernel_name']!r}, expected {kernel_name!r}")
    return data


def dump_fla_configs(out_dir: Path) -> int:
    """Write every tuned key of the loaded FLA autotuners to ``out_dir/{kernel_name}.json``, merged with the
    entries already there (a re-tuned key replaces its old entry). Returns the number of entries written."""
    import triton

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"dump_fla_configs: {out_dir} exists and is not a directory")
    collected = collect_fla_entries()
    if not collected:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for kernel_name, new_entries in sorted(collected.items()):
        path = out_dir / f"{kernel_name}.json"
        entries: dict[str, dict[str, Any]] = {}
        if path.exists():
            old = _read_existing(path, kernel_name)
            if old.get("triton_version") not in (None, triton.__version__):
                logger.warning("%s was tuned with triton %s; merging entries from triton %s", path,
                               old["triton_version"], triton.__version__)
            entries.update(old["autotune_entries"])
        entries.update(new_entries)
        data = {
            "kernel_name": kernel_name,
            "triton_version": triton.__version__,
            "autotune_entries": entries,
            "default_config": _default_config(entries),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
        written += len(new_entries)
    return written
