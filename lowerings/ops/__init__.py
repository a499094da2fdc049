"""Ops the model calls. Each is a ``torch.ops.titan_kimi.*`` custom op with a CPU reference; see docs/ops.md."""

from lowerings.ops.attention import causal_attention, document_causal_mask
from lowerings.ops.attn_res_mix import attn_res_mix
from lowerings.ops.indexer_kl import (attention_lse, dense_indexer_kl, indexer_scores_at, selected_mass,
                                     sparse_indexer_kl, sparse_kl_from_scores, sparse_mla_distilled)
from lowerings.ops.indexer_topk import indexer_topk
from lowerings.ops.kda import kda
from lowerings.ops.kda_cp import kda_context_parallel
from lowerings.ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy
from lowerings.ops.registry import configure_backends, known_ops, op_backends, selected_backend
from lowerings.ops.routed_combine import (combine_present, combine_rows, dispatch_present, dispatch_rows,
                                          route_rows, sum_present)
from lowerings.ops.router_logits import router_logits
from lowerings.ops.short_conv import short_conv
from lowerings.ops.situ_glu import situ_glu
from lowerings.ops.sparse_mla import sparse_mla

__all__ = [
    "attention_lse",
    "attn_res_mix",
    "IGNORE_INDEX",
    "causal_attention",
    "combine_present",
    "combine_rows",
    "configure_backends",
    "dense_indexer_kl",
    "dispatch_present",
    "dispatch_rows",
    "document_causal_mask",
    "indexer_scores_at",
    "indexer_topk",
    "kda",
    "kda_context_parallel",
    "known_ops",
    "linear_cross_entropy",
    "route_rows",
    "router_logits",
    "op_backends",
    "selected_backend",
    "selected_mass",
    "short_conv",
    "situ_glu",
    "sparse_indexer_kl",
    "sparse_kl_from_scores",
    "sparse_mla",
    "sparse_mla_distilled",
    "sum_present",
]
