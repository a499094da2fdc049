"""Training the K3.1 indexer by distillation from the main attention (the DeepSeek-V3.2 recipe; spec §16b).

``index_training`` (model args):

* ``warmup``: the DSA layers attend densely; the indexer's softmax over every causal key of the document learns
  the main attention's head-summed, L1-normalised probabilities (KL, blockwise: ``ops.dense_indexer_kl``).
* ``sparse``: the DSA layers attend to the indexer's top-k; the KL runs over the selected keys only. Its
  gradient comes from the sparse attention's backward (``ops.sparse_mla_distilled``: the target is the
  head-summed probabilities that backward recomputes), its value (``ops.sparse_kl_from_scores``, from the
  forward's LSE) only on measured (logging) forwards. Batches whose queries all have at most top-k causal keys
  (``seq.dsa_dense``) attend densely, and their selection being every causal key, the KL is the dense one.

The indexer reads detached inputs and its top-k is hard, so the main model learns only from the LM loss; the
main attention's tensors enter the KL detached, so the indexer learns only from the KL. The KL's gradient joins
the backward through the layer's output (`attach_loss` for the dense KL, the attention's own backward for the
sparse one): it reaches the indexer whatever runs the backward (a pipeline schedule included), and the LM loss
is unchanged.

Per query, the KL counts over real tokens (not padding); the recall, measured when ``seq.indexer_metrics``, is
the share of the main attention's probability mass (dense, averaged over heads) inside the selected top-k,
over the real queries with more causal keys than top-k (for the others it is 1 by construction).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lowerings import ops
from titan_kimi.models.kimi_k3.indexer import Indexer
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, query_runs


class DistilledMLA(Protocol):
    """What ``distilled_attention`` reads of the DSA layer (``mla.GatedMLA``), which calls it."""

    indexer: Indexer
    scale: float
    kv_lora_rank: int

    def latent_queries(self, q: torch.Tensor) -> torch.Tensor: ...

    def dense_attention(self, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                        seq: SequenceInfo) -> torch.Tensor: ...

    def sparse_attention(self, q_latent: torch.Tensor, kv_latent: torch.Tensor, indices: torch.Tensor, B: int,
                         S: int, distill: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]: ...


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, gives ``loss`` the gradient 1, as if it had been added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype = ctx.loss_meta
        return grad_out, torch.ones(shape, dtype=dtype, device=grad_out.device)


def attach_loss(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``out``, with ``loss`` (a scalar) joining whatever loss is later backpropagated through ``out``."""
    return _AttachLoss.apply(out, loss)


def _real(seq: SequenceInfo, T: int, device: torch.device) -> torch.Tensor:
    return seq.is_real if seq.is_real is not None else torch.ones(T, dtype=torch.bool, device=device)


def _causal_keys(seq: SequenceInfo, device: torch.device) -> torch.Tensor:
    """``[B*S]``: how many keys each local query may attend to (its position in its segment, plus one)."""
    if seq.pos_in_seg is not None:
        return seq.pos_in_seg.reshape(-1) + 1
    pos = seq.positions if seq.positions is not None else torch.arange(seq.seq_len, device=device).expand(
        seq.batch, -1)
    return pos.reshape(-1) + 1


def _dense_lse(q_lat: torch.Tensor, kv_rows: torch.Tensor, seq: SequenceInfo, scale: float) -> torch.Tensor:
    """The main attention's LSE over every causal key, ``[T,H]``; ``kv_rows [B, row length, D]``."""
    flat = kv_rows.reshape(-1, kv_rows.shape[-1])
    parts = [ops.attention_lse(q_lat[r.rows], flat if r.row is None else kv_rows[r.row], r.seg_start, scale=scale,
                               q_offset=r.q_offset) for r in query_runs(seq)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _dense_kl(iq, ik_rows, iw, q_lat, kv_rows, lse, seq: SequenceInfo, index_scale: float, scale: float):
    ik_flat, kv_flat = ik_rows.reshape(-1, ik_rows.shape[-1]), kv_rows.reshape(-1, kv_rows.shape[-1])
    parts = []
    for r in query_runs(seq):
        ik, kv = (ik_flat, kv_flat) if r.row is None else (ik_rows[r.row], kv_rows[r.row])
        parts.append(ops.dense_indexer_kl(iq[r.rows], ik, iw[r.rows], q_lat[r.rows], kv, lse[r.rows], r.seg_start,
                                          index_scale=index_scale, scale=scale, q_offset=r.q_offset))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def distilled_attention(mla: DistilledMLA, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor,
                        c_kv: torch.Tensor, k_rope: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
    """The DSA layer's attention output ``[B,S,n,v]`` while its indexer trains, with the indexer's KL attached.

    ``c_kv``, ``k_rope``: the rows' latent keys (the whole rows' under context parallelism)."""
    indexer = mla.indexer
    B, S = x.shape[:2]
    T = B * S
    iq, ik, iw = indexer.project(x, q_latent)
    ik_rows = indexer.row_keys(ik, seq)
    latent = torch.cat([c_kv, k_rope], dim=-1)  # [B, row length, 576]: the sparse attention's keys
    kv_rows = latent.detach()  # the target's
    q_lat = mla.latent_queries(q)
    kv_flat = kv_rows.reshape(-1, kv_rows.shape[-1])
    training = torch.is_grad_enabled()
    dense = indexer.training_mode == "warmup" or seq.dsa_dense
    real = _real(seq, T, x.device)
    queries = real.sum().float()
    scale = seq.indexer_loss_scale
    if scale is None:  # the mean over this forward's real queries and every DSA layer
        scale = 1.0 / (queries.clamp(min=1.0) * indexer.layers_with_indexer)
    if dense:
        out = mla.dense_attention(q, c_kv, k_rope, seq)
        if not training:
            return out
        lse_all = _dense_lse(q_lat.detach(), kv_rows, seq, mla.scale)
        kl = _dense_kl(iq, ik_rows, iw, q_lat.detach(), kv_rows, lse_all, seq, indexer.scale, mla.scale)
        lse_selected = None
        if seq.indexer_metrics and not seq.dsa_dense:
            with torch.no_grad():
                idx = indexer.select(iq, ik, iw, seq)
                lse_selected = ops.sparse_mla(q_lat.detach(), kv_flat, idx, scale=mla.scale, d_v=mla.kv_lora_rank)[1]
    else:
        idx = indexer.select(iq, ik, iw, seq)
        latent_flat = latent.reshape(-1, latent.shape[-1])
        if not training:
            return mla.sparse_attention(q_lat, latent_flat, idx, B, S)[0]
        # the KL's gradient reaches the scores from the attention's backward, whose recomputed probabilities
        # are the target; its value is measured on logging steps only (it needs the target in the forward)
        scores = ops.indexer_scores_at(iq, ik_rows.reshape(-1, ik_rows.shape[-1]), iw, idx, index_scale=indexer.scale)
        weight = torch.where(real, scale, 0.0) if isinstance(scale, torch.Tensor) else real.float() * scale
        out, lse_selected = mla.sparse_attention(q_lat, latent_flat, idx, B, S, distill=(scores, weight))
        kl, lse_all = None, None
        if seq.indexer_metrics:
            kl = ops.sparse_kl_from_scores(q_lat.detach(), kv_flat, lse_selected, idx, scores, scale=mla.scale)
            lse_all = _dense_lse(q_lat.detach(), kv_rows, seq, mla.scale)
    mass_sum = mass_queries = torch.zeros((), dtype=torch.float32, device=x.device)
    if lse_selected is not None and lse_all is not None:
        counted = real & (_causal_keys(seq, x.device) > indexer.topk)
        mass = ops.selected_mass(lse_selected.detach(), lse_all)
        mass_sum, mass_queries = torch.where(counted, mass, torch.zeros_like(mass)).sum(), counted.sum().float()
    if kl is None:  # sparse, not measured: the KL's gradient comes through sparse_mla_distilled, no value
        return out
    kl_sum = torch.where(real, kl, torch.zeros_like(kl)).sum()
    indexer.record(kl_sum.detach(), queries, mass_sum, mass_queries)
    return out if not dense else attach_loss(out, kl_sum * scale)
