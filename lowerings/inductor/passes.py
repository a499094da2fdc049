"""The titan_kimi joint-graph pass: our pattern rewrites, as a ``CustomGraphPass`` Inductor can cache on.

Installed only through the ``inductor`` compile mode's ``torch.compile(options={"joint_custom_post_pass": ...})``
(never globally). It runs after Inductor's own joint-graph normalisation (no-op removal, early patterns), which
is the form ``joint_fwd_bwd``-traced patterns are written against, on training (joint) and inference graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import PatternMatcherPass

from lowerings.ops.registry import selected_backend

# Files whose code decides what the pass does (patterns, search formula, replacement ops).
_SOURCES = tuple(str(p) for p in (
    Path(__file__).with_name("passes.py"),
    Path(__file__).with_name("situ_glu_pattern.py"),
    Path(__file__).parents[1] / "ops" / "situ_glu.py",
))

COUNTER = "titan_kimi"  # torch._dynamo.utils.counters[COUNTER]["situ_glu_rewrites"]: matches replaced


class TitanKimiJointPass(CustomGraphPass):
    """Rewrites plain-torch subgraphs the model emits under the ``inductor`` mode into fused titan_kimi ops."""

    def __init__(self, *, triton_ops: bool = False) -> None:
        self.triton_ops = triton_ops
        self._patterns: PatternMatcherPass | None = None

    def patterns(self) -> PatternMatcherPass:
        if self._patterns is None:  # traced on first use, not at import (tracing takes ~0.2 s)
            from lowerings.inductor.situ_glu_pattern import register_situ_glu_patterns

            patterns = PatternMatcherPass(pass_name="titan_kimi_joint_pass")
            # register_replacement skips training patterns under inference mode, and the pass keeps what it got.
            with torch.inference_mode(False):
                register_situ_glu_patterns(patterns, triton_ops=self.triton_ops)
            self._patterns = patterns
        return self._patterns

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrites = self.patterns().apply(graph)
        if rewrites:
            # Replacements are inserted unsorted; joint_graph_passes re-sorts the graph after the custom passes.
            counters[COUNTER]["situ_glu_rewrites"] += rewrites

    def uuid(self) -> Any:
        # The replacement op depends on the flag and on the selected backend, so both join the cache key
        # (an FX/AOTAutograd cache hit skips this pass and must not reuse a graph with the other op).
        return (get_hash_for_files(_SOURCES), self.triton_ops, selected_backend("situ_glu"))
