"""Model FLOPs of one decoder layer (and of a stage's head) for one microbatch, split the way a pipeline
schedule runs them: forward, input gradients, weight gradients.

The conventions of ``accounting.py`` (2 FLOPs per weight per row in each of the three passes; the token
mixers' terms per query and key; the frozen indexer forward only; sparse attention counted over its top-k),
but per layer and for the microbatch's real segments: attention stays inside a segment (padding runs included,
as the model's segments are), so a padded row's work depends on where its example ends. Routed experts run on
the rows this rank's local experts receive (``routed_rows``), not on this rank's own tokens.

Not counted (as in ``accounting.py``): norms, activations, the AttnRes mixes, routing, permutations;
activation-checkpoint recomputation (it is executed work, not model work: add one forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_kimi.models.kimi_k3.accounting import KDA_CHUNK
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs


@dataclass(frozen=True)
class LayerFlops:
    forward: float
    backward_input: float  # gradients of the layer's inputs (what the previous layer waits for)
    backward_weight: float  # gradients of its trained weights

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: "LayerFlops") -> "LayerFlops":
        return LayerFlops(self.forward + other.forward, self.backward_input + other.backward_input,
                          self.backward_weight + other.backward_weight)


ZERO = LayerFlops(0.0, 0.0, 0.0)


def causal_keys(segments: Sequence[int], cap: int | None = None) -> float:
    """Keys summed over every query of runs of ``segments`` tokens, each query's keys capped at ``cap``."""
    total = 0.0
    for n in segments:
        if cap is None or cap >= n:
            total += n * (n + 1) / 2
        else:
            total += cap * (cap + 1) / 2 + (n - cap) * cap
    return total


def row_segments(doc_ids: torch.Tensor) -> list[int]:
    """Run lengths of equal doc ids over every row of ``doc_ids [B, S]`` (padding runs included)."""
    out: list[int] = []
    for row in doc_ids.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        out += counts.tolist()
    return out


def weight_flops(module: torch.nn.Module, tokens: int, *, routed_rows: int | None = None,
                 with_indexer: bool = True) -> LayerFlops:
    """2 FLOPs per weight per row in each pass: every weight on ``tokens`` rows, except routed experts (on the
    rows their layer's local experts receive: ``routed_rows``, default their share of ``tokens x top_k``) and
    the frozen indexer (forward only, its inputs detached; nothing without ``with_indexer``)."""
    from titan_kimi.models.kimi_k3.indexer import Indexer
    from titan_kimi.models.kimi_k3.moe import LatentMoE

    rows_of: dict[int, tuple[float, int]] = {}  # id(param) -> (rows, experts in its module)
    for moe in (m for m in module.modules() if isinstance(m, LatentMoE)):
        local = moe.experts.num_experts
        rows = routed_rows if routed_rows is not None else tokens * moe.top_k * local / moe.num_experts
        rows_of.update({id(p): (rows, local) for p in moe.experts.parameters()})
    indexer = {id(p) for m in module.modules() if isinstance(m, Indexer) for p in m.parameters()}
    fwd = b_in = b_w = 0.0
    for p in module.parameters():
        if id(p) in indexer:
            fwd += 2.0 * tokens * p.numel() if with_indexer else 0.0
            continue
        rows, experts = rows_of.get(id(p), (tokens, 1))
        work = 2.0 * rows * p.numel() / experts
        fwd, b_in = fwd + work, b_in + work
        b_w += work if p.requires_grad else 0.0
    return LayerFlops(fwd, b_in, b_w)


def attention_flops(args: KimiK3ModelArgs, layer: int, segments: Sequence[int], *, dsa_dense: bool) -> LayerFlops:
    """The token mixer's terms that its weights do not capture (backward twice the forward, input side)."""
    tokens = sum(segments)
    if args.is_kda_layer(layer):
        k = v = args.kda_head_dim
        fwd = tokens * args.kda_num_heads * 2 * (3 * k * v + KDA_CHUNK * (k + v))
        return LayerFlops(fwd, 2 * fwd, 0.0)
    if args.has_indexer and not dsa_dense:
        latent = args.kv_lora_rank + args.qk_rope_head_dim
        fwd = 2 * args.n_heads * (latent + args.kv_lora_rank) * causal_keys(segments, args.index_topk)
        scores = 2 * args.index_n_heads * (args.index_head_dim + 1) * causal_keys(segments)
        return LayerFlops(fwd + scores, 2 * fwd, 0.0)  # the indexer's scores run forward only
    fwd = 2 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * causal_keys(segments)
    return LayerFlops(fwd, 2 * fwd, 0.0)


def block_flops(block: torch.nn.Module, args: KimiK3ModelArgs, segments: Sequence[int], *,
                routed_rows: int | None = None, dsa_dense: bool = False) -> LayerFlops:
    """Decoder layer ``block`` (a ``KimiK3Block``, on any device, meta included) on a microbatch whose rows hold
    runs of ``segments`` tokens; ``routed_rows``: rows its (local) routed experts receive (None: the block's
    experts are all local and get ``tokens x top_k`` rows)."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    weights = weight_flops(inner, sum(segments), routed_rows=routed_rows, with_indexer=not dsa_dense)
    return weights + attention_flops(args, inner.layer_id, segments, dsa_dense=dsa_dense)


def attention_part_flops(block: torch.nn.Module, args: KimiK3ModelArgs, segments: Sequence[int], *,
                         dsa_dense: bool = False) -> LayerFlops:
    """The block's attention norm and token mixer alone."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    tokens = sum(segments)
    weights = (weight_flops(inner.attention_norm, tokens)
               + weight_flops(inner.attention, tokens, with_indexer=not dsa_dense))
    return weights + attention_flops(args, inner.layer_id, segments, dsa_dense=dsa_dense)


def ffn_part_flops(block: torch.nn.Module, tokens: int, *, routed_rows: int | None = None) -> LayerFlops:
    """The block's FFN norm and FFN (MoE or dense MLP) alone."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    ffn = inner.moe if inner.moe_enabled else inner.feed_forward
    return weight_flops(inner.ffn_norm, tokens) + weight_flops(ffn, tokens, routed_rows=routed_rows)


def head_flops(args: KimiK3ModelArgs, tokens: int, *, trained: bool = True) -> LayerFlops:
    """The last stage's lm_head through the fused cross-entropy (its logits recomputed inside the fused loss
    backward are executed work, not counted)."""
    fwd = 2.0 * tokens * args.dim * args.vocab_size
    return LayerFlops(fwd, fwd, fwd if trained else 0.0)
