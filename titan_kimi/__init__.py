"""titan_kimi: a compiler-first trainer for Kimi K3 / K3.1. ``from titan_kimi import from_pretrained`` loads an HF
checkpoint folder into a ready model (imported on first use, so ``import titan_kimi.config`` stays torch-free)."""

from typing import Any

__all__ = ["from_pretrained"]


def __getattr__(name: str) -> Any:
    if name == "from_pretrained":
        from titan_kimi.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'titan_kimi' has no attribute {name!r}")
