"""The Kimi K3 / K3.1 text model, buildable whole or as a pipeline stage of whole AttnRes blocks."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.attn_res import AttnResMix
from titan_kimi.models.kimi_k3.block import KimiK3Block
from titan_kimi.models.kimi_k3.head import LMHead
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared
from titan_kimi.models.kimi_k3.norms import RMSNorm
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, SequenceSharding, build_sequence_info


class KimiK3Model(nn.Module):
    """Embedding -> decoder layers -> final AttnRes mix -> norm -> lm_head.

    ``layer_range=(first, last)`` builds a stage with layers ``[first, last)``: the first stage owns the
    embedding, the last one the output mix, norm and lm_head. With AttnRes, stage boundaries must fall on
    block boundaries, and a stage that is not last returns ``(hidden, bank)`` instead of logits.
    ``allow_block_cut=True`` lifts that rule for a benchmark that builds only a stage's first layers (the rank
    slice's ``max_layers``); such a part returns ``(hidden, bank)`` and is no stage of a real run.
    """

    def __init__(self, args: KimiK3ModelArgs, layer_range: tuple[int, int] | None = None, *,
                 allow_block_cut: bool = False) -> None:
        super().__init__()
        self.args = args
        first, last = layer_range if layer_range is not None else (0, args.n_layers)
        if not 0 <= first < last <= args.n_layers:
            raise ValueError(f"layer_range {layer_range} must satisfy 0 <= first < last <= n_layers={args.n_layers}")
        block = args.attn_res_block_size
        if block and not allow_block_cut and (first % block or (last % block and last != args.n_layers)):
            raise ValueError(
                f"layer_range {layer_range} cuts an AttnRes block: stage boundaries must be multiples of "
                f"attn_res_block_size={block} (or n_layers={args.n_layers})"
            )
        self.first_layer, self.last_layer = first, last
        self.is_first, self.is_last = first == 0, last == args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): KimiK3Block(i, args) for i in range(first, last)})
        if self.is_last:
            self.output_mix = AttnResMix(args.dim, args.norm_eps, args.init_std) if block else None
            self.norm = RMSNorm(args.dim, eps=args.norm_eps)
            self.output = LMHead(args.dim, args.vocab_size)
        else:
            self.output_mix = self.norm = self.output = None

    def forward(
        self,
        x: torch.Tensor,
        bank: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        seq: SequenceInfo | None = None,
        return_hidden: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        max_causal_keys: int | None = None,
        indexer_loss_scale: float | torch.Tensor | None = None,
        indexer_metrics: bool = False,
        context_parallel: SequenceSharding | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Positional stage I/O, as pipeline stages receive it: the first stage takes ``x = tokens [B,S]``; a
        later stage takes ``x = hidden [B,S,H]`` and ``bank [B*S,m,H]`` from the stage before. Instead of tokens,
        the first stage takes ``inputs_embeds [B,S,H]`` (with ``x = None``): the image-text model's merged text
        and image embeddings.

        ``doc_ids [B,S]`` (0 = padding) makes attention document-causal and resets KDA at each document.
        A stage that is not last returns ``(hidden, bank)``. The last stage returns logits ``[B,S,V]``, or with
        ``return_hidden`` the final normed hidden states ``[B,S,H]``, to which the training loss applies the head
        chunk by chunk (``titan_kimi.training.loss``) so that ``[B,S,V]`` logits never exist.

        ``context_parallel``: under context parallelism, this rank's share of every row (``SequenceSharding``):
        ``x`` holds this rank's tokens, ``doc_ids`` the whole rows', and the sequence it builds carries the
        exchange through which each attention and KDA layer reaches the rest of the row. None: whole rows.

        ``max_causal_keys``: the most causal keys any trained query of the batch has (its longest document,
        ``titan_kimi.data.causal_keys.longest_document`` of the host batch); None = unknown, the whole row.

        While the indexer trains (``args.index_training`` warmup / sparse): ``indexer_loss_scale`` weighs each
        real query's KL in the loss (the trainer passes the KL weight over the step's real queries and DSA
        layers; None = the mean over this forward's), and ``indexer_metrics`` measures the indexer's recall
        (``titan_kimi.models.kimi_k3.indexer_distillation``).
        """
        if self.is_first:
            if inputs_embeds is not None:
                if x is not None:
                    raise ValueError("the first stage takes token ids or inputs_embeds, not both")
                hidden = inputs_embeds
            elif x is None or x.is_floating_point():
                raise ValueError("the first stage takes token ids [B, S] (an integer tensor) or inputs_embeds")
            else:
                hidden = self.tok_embeddings(x)
            if torch.is_grad_enabled() and not hidden.requires_grad:
                # frozen embeddings (LoRA): the first layer's input then requires grad as every other layer's
                # does, so torch.compile makes one graph per module kind, not a second one for layer 0 (on the
                # H200 two more graphs in step 1 of the image-text LoRA run)
                hidden = hidden.detach().requires_grad_()
            bank = hidden.new_empty(hidden.shape[0] * hidden.shape[1], 0, hidden.shape[2])
        elif inputs_embeds is not None:
            raise ValueError(f"inputs_embeds go to the first stage; this stage starts at layer {self.first_layer}")
        elif x is None or bank is None:
            raise ValueError(
                f"a stage starting at layer {self.first_layer} needs hidden and bank from the previous stage"
            )
        else:
            hidden = x
        B, S = hidden.shape[:2]
        if seq is None:
            seq = self.build_sequence(B, S, hidden.device, doc_ids, context_parallel)
            seq.dsa_dense = self.dsa_dense(seq, max_causal_keys)
        if self.args.indexer_trains:
            if indexer_loss_scale is not None:  # a tensor, so a new value each step compiles nothing
                seq.indexer_loss_scale = torch.as_tensor(indexer_loss_scale, dtype=torch.float32,
                                                         device=hidden.device).reshape(())
            seq.indexer_metrics = bool(indexer_metrics)
        for layer in self.layers.values():
            hidden, bank = layer(hidden, bank, seq)
        if not self.is_last:
            return hidden, bank
        if self.output_mix is not None:
            hidden = self.output_mix(bank, hidden)
        hidden = self.norm(hidden)
        return hidden if return_hidden else self.output(hidden)

    @staticmethod
    def build_sequence(batch: int, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None,
                       context_parallel: SequenceSharding | None = None) -> SequenceInfo:
        """A forward's document structure: the whole rows', or this rank's share under context parallelism."""
        if context_parallel is not None:
            return context_parallel.build_sequence(batch, seq_len, device, doc_ids)
        return build_sequence_info(batch, seq_len, device, doc_ids)

    def dsa_dense(self, seq: SequenceInfo, max_causal_keys: int | None) -> bool:
        """Whether no trained query has more causal keys than ``index_topk``: then the indexer would select every
        causal key and sparse attention equals dense causal attention. Decided on the host from the row length
        (the whole row's under context parallelism) and ``max_causal_keys``; never from device values.

        Exact for everything that is trained: a query of a document has at most its document's length of causal
        keys (attention stays inside a segment). Padding rows (doc id 0, label -100, e.g. nonpacked MedPix up to
        seq_len) may have more and then attend differently, but their outputs stay in their own segment (no
        valid query attends to them; KDA and the short conv reset at every segment start; MoE routes per token,
        without capacity) and never reach the loss, so losses and gradients are the same; only the routing
        counts of padding tokens (a metric) can differ."""
        if max_causal_keys is not None and (not isinstance(max_causal_keys, int) or max_causal_keys < 0):
            raise ValueError(f"max_causal_keys = {max_causal_keys!r}: expected a Python int >= 0, or None (unknown)")
        if not (self.args.dsa_dense_shortcut and self.args.has_indexer):
            return False
        row = seq.exchange.global_len if seq.exchange is not None else seq.seq_len
        keys = row if max_causal_keys is None else min(row, max_causal_keys)
        return keys <= self.args.index_topk

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        """The embedding (the first stage's): N(0, init_std), the padding row zero. Every other module declares its
        own (``init_specs``)."""
        if self.tok_embeddings is None:
            return {}
        return {"tok_embeddings.weight": InitSpec("normal", std=self.args.init_std,
                                                  zero_rows=(self.args.pad_token_id,))}

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Spec §14: N(0, init_std) linears and embedding, unit norms, lm_head truncated normal H^-1/2."""
        init_declared(self)
        for layer in self.layers.values():
            layer.init_weights()
        if self.is_last:
            if self.output_mix is not None:
                self.output_mix.init_weights()
            self.norm.init_weights()
            self.output.init_weights()
