"""Count graph breaks of a module call under ``torch._dynamo.explain`` (no compilation is run)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo


@dataclass(frozen=True)
class BreakReport:
    graphs: int
    breaks: int
    reasons: list[str]


def count_graph_breaks(fn, *args, **kwargs) -> BreakReport:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return BreakReport(explanation.graph_count, explanation.graph_break_count,
                       [str(r.reason) for r in explanation.break_reasons])
