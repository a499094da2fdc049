"""Per-block torch.compile under the ``[compile]`` modes (the mode registry lives in lowerings.inductor)."""

from __future__ import annotations

from lowerings.inductor.modes import compile_options
from titan_kimi.models.kimi_k3.model import KimiK3Model


def apply_compile(model: KimiK3Model, mode: str, *, fullgraph: bool) -> None:
    """Compile every decoder block in place (parameter names unchanged); ``none`` leaves the model eager."""
    options = compile_options(mode)
    if options is None:
        return
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph, **options)
