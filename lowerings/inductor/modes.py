"""The compile-mode registry shared by training and the ablation script.

| mode | what runs |
|---|---|
| none | eager |
| default | per-block torch.compile (Inductor); the titan_kimi ops stay opaque custom ops |
| max-autotune | as default, with Inductor's GEMM/pointwise autotuning (no CUDA graphs) |
| reduce-overhead | as default, with CUDA graphs over the graph partitions |
"""

from __future__ import annotations

from typing import Any

_MODES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "default": {"backend": "inductor"},
    "max-autotune": {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
    "reduce-overhead": {"backend": "inductor", "mode": "reduce-overhead"},
}


def compile_mode_names() -> list[str]:
    return list(_MODES)


def compile_options(mode: str) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments for ``mode``; None for eager."""
    if mode not in _MODES:
        raise ValueError(f"compile.mode = {mode!r} is not available; valid: {compile_mode_names()}")
    return _MODES[mode]
