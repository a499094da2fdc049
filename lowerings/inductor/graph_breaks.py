"""Count graph breaks of a module call under ``torch._dynamo.explain`` (no compilation is run)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo

from lowerings.inductor.modes import lowering_scope


@dataclass(frozen=True)
class BreakReport:
    graphs: int
    breaks: int
    reasons: list[str]


def count_graph_breaks(fn, *args, mode: str = "default", **kwargs) -> BreakReport:
    """Trace ``fn(*args, **kwargs)`` as compile mode ``mode`` would (its op lowering: formulas, triton_ops)."""
    torch._dynamo.reset()
    with lowering_scope(mode):
        explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return BreakReport(explanation.graph_count, explanation.graph_break_count,
                       [str(r.reason) for r in explanation.break_reasons])
