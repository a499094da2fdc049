"""Parameter counts and training FLOPs per token (for MFU).

Counting conventions (spec §8): "total" is every parameter, including the frozen router bias and indexer;
"active" is what one token touches: the input embedding is excluded (a lookup, not a matmul), lm_head is
included, and only top-k of the routed experts count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    embedding: int
    frozen: int  # active parameters without gradients (the part of frozen experts a token touches)
    routed: int = 0  # the routed experts' active parameters (included in active), which padding tokens skip
    routed_frozen: int = 0  # of those, the ones without gradients


def count_params(model: nn.Module, *, skip_prefixes: tuple[str, ...] = ()) -> ParamCounts:
    """Counts over the parameters this module holds (a pipeline stage counts only its own), except those whose
    names start with ``skip_prefixes`` (e.g. an image-text model's tower, whose FLOPs are per image patch)."""
    args: KimiK3ModelArgs = model.args
    total = embedding = frozen = inactive = routed = routed_frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(skip_prefixes):
            continue
        n = p.numel()
        total += n
        skipped = 0
        if name.startswith("tok_embeddings."):
            embedding += n
            skipped = n
        if ".moe.experts." in name:
            skipped = n * (args.num_experts - args.num_experts_per_tok) // args.num_experts
            inactive += skipped
            routed += n - skipped
            routed_frozen += 0 if p.requires_grad else n - skipped
        if not p.requires_grad:
            frozen += n - skipped
    return ParamCounts(total, total - embedding - inactive, embedding, frozen, routed, routed_frozen)


def _mean_keys(seq_len: int, cap: int | None = None) -> float:
    """Average number of causal keys per query over a sequence, each capped at ``cap`` (top-k)."""
    if cap is None or cap >= seq_len:
        return (seq_len + 1) / 2
    # Queries 0..cap-1 see t+1 keys, the rest see exactly cap.
    return (cap * (cap + 1) / 2 + (seq_len - cap) * cap) / seq_len


KDA_CHUNK = 64


def attention_flops_per_token(args: KimiK3ModelArgs, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs per token of the token-mixing terms that parameters do not capture.

    Returns (trained, forward_only): the indexer has no gradient, so its scores are never differentiated.
    """
    trained = forward_only = 0.0
    for layer in range(args.n_layers):
        if args.is_kda_layer(layer):
            k = v = args.kda_head_dim
            # Chunked delta rule: S^T q, S^T k, the k u^T update (3 K*V products) + intra-chunk q.k / k.k terms.
            trained += args.kda_num_heads * 2 * (3 * k * v + KDA_CHUNK * (k + v))
        elif args.has_indexer:
            latent = args.kv_lora_rank + args.qk_rope_head_dim
            trained += 2 * args.n_heads * (latent + args.kv_lora_rank) * _mean_keys(seq_len, args.index_topk)
            forward_only += 2 * args.index_n_heads * (args.index_head_dim + 1) * _mean_keys(seq_len)
        else:
            trained += 2 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * _mean_keys(seq_len)
    return trained, forward_only


def training_flops_per_token(args: KimiK3ModelArgs, seq_len: int, counts: ParamCounts | None = None, *,
                             frozen_backward: bool = False) -> float:
    """Forward + backward FLOPs per token: 6 per trained active weight, 2 per frozen one, attention terms.

    Backward costs twice the forward for every trained term; frozen terms run forward only, except with
    ``frozen_backward`` (LoRA: the gradient flows through the frozen base weights to the adapters), where they
    cost 4 (forward and input gradient).
    """
    if counts is None:
        counts = _counts_on_meta(args)
    trained_params = counts.active - counts.frozen
    attn_trained, attn_frozen = attention_flops_per_token(args, seq_len)
    frozen_cost = 4 if frozen_backward else 2
    return 6 * trained_params + frozen_cost * counts.frozen + 3 * attn_trained + attn_frozen


def routed_expert_flops_per_token(counts: ParamCounts, *, frozen_backward: bool = False) -> float:
    """The part of ``training_flops_per_token`` spent in the routed experts: what a padding token, which skips
    them, does not cost."""
    return 6 * (counts.routed - counts.routed_frozen) + (4 if frozen_backward else 2) * counts.routed_frozen


def _counts_on_meta(args: KimiK3ModelArgs) -> ParamCounts:
    import torch

    from titan_kimi.models.kimi_k3.model import KimiK3Model

    with torch.device("meta"):
        return count_params(KimiK3Model(args))
