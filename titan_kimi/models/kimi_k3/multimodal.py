"""The Kimi K3 / K3.1-Pro image-text model (``KimiK3ForConditionalGeneration`` / ``KimiK31ForConditionalGeneration``
semantics, spec §10): the text model whose first stage also holds the MoonViT3d tower and the projector.

The tower and projector sit beside the text modules (``vision_tower.*``, ``mm_projector.*``, as in the
checkpoint), so the text model's names, key plans and parallelisation apply unchanged. On the first stage
``forward(tokens, pixel_values=..., grid_thws=...)`` embeds the tokens, runs the tower on the packed images,
projects the merged tokens and expands each image's single placeholder into its ``(h/2)(w/2)`` positions
(``multimodal_merge``), then runs the text layers on the merged embeddings. Later stages are text stages.
"""

from __future__ import annotations

import torch

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.multimodal_merge import merge_image_features
from titan_kimi.models.kimi_k3.projector import PatchMergerMLP
from titan_kimi.models.kimi_k3.sequence import SequenceInfo, SequenceSharding
from titan_kimi.models.kimi_k3.vision import VisionTower
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class KimiK3VLModel(KimiK3Model):
    def __init__(self, args: KimiK3ModelArgs, vision: KimiK3VisionArgs,
                 layer_range: tuple[int, int] | None = None, *, allow_block_cut: bool = False) -> None:
        super().__init__(args, layer_range, allow_block_cut=allow_block_cut)
        self.vision_args = vision
        self.placeholder_id = vision.media_placeholder_token_id
        if not 0 <= self.placeholder_id < args.vocab_size:
            raise ValueError(f"media_placeholder_token_id = {self.placeholder_id} is not a token id of the "
                             f"{args.vocab_size}-token vocabulary")
        if self.is_first:
            self.vision_tower = VisionTower(vision)
            self.mm_projector = PatchMergerMLP(vision, args.dim)
        else:
            self.vision_tower = self.mm_projector = None

    def tokens_per_image(self, grid_thws: torch.Tensor) -> torch.Tensor:
        kh, kw = self.vision_args.merge_kernel
        return (grid_thws[:, 1] // kh) * (grid_thws[:, 2] // kw)

    def image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Projected merged tokens ``[sum n_i, dim]`` of the packed images. A frozen tower runs without autograd."""
        tower_trains = any(p.requires_grad for p in self.vision_tower.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and tower_trains):
            features = self.vision_tower(pixel_values, grid_thws)
        return self.mm_projector(features)

    def embed(self, tokens: torch.Tensor, pixel_values: torch.Tensor | None, grid_thws: torch.Tensor | None,
              seq_len: int | None = None) -> torch.Tensor:
        """Merged embeddings ``[B, S, dim]``: ``S = seq_len``, or the longest expanded row when None."""
        text = self.tok_embeddings(tokens)
        if pixel_values is None or grid_thws is None or grid_thws.shape[0] == 0:
            features = text.new_zeros(0, text.shape[-1])
            counts = torch.zeros(0, dtype=torch.int64, device=tokens.device)
        else:
            features, counts = self.image_features(pixel_values, grid_thws), self.tokens_per_image(grid_thws)
        return merge_image_features(tokens, text, features, counts, self.placeholder_id, seq_len=seq_len).inputs_embeds

    def forward(
        self,
        x: torch.Tensor,
        bank: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        seq: SequenceInfo | None = None,
        return_hidden: bool = False,
        max_causal_keys: int | None = None,
        indexer_loss_scale: float | torch.Tensor | None = None,
        indexer_metrics: bool = False,
        context_parallel: SequenceSharding | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``x = tokens [B, U]`` with one placeholder per image, ``pixel_values [L, 3, 14, 14]`` and
        ``grid_thws [N, 3]``; ``doc_ids [B, S]`` (and the labels the loss uses) describe the expanded sequence,
        whose length S they fix (without them: the longest expanded row). Later stages: as the text model."""
        if not self.is_first:
            if pixel_values is not None or grid_thws is not None:
                raise ValueError(f"images go to the first stage; this stage starts at layer {self.first_layer}")
            return super().forward(x, bank, doc_ids=doc_ids, seq=seq, return_hidden=return_hidden,
                                   max_causal_keys=max_causal_keys, indexer_loss_scale=indexer_loss_scale,
                                   indexer_metrics=indexer_metrics, context_parallel=context_parallel)
        if x is None or x.is_floating_point():
            raise ValueError("the image-text model's first stage takes token ids [B, U] (an integer tensor)")
        seq_len = doc_ids.shape[1] if doc_ids is not None else (seq.seq_len if seq is not None else None)
        embeds = self.embed(x, pixel_values, grid_thws, seq_len)
        return super().forward(None, doc_ids=doc_ids, seq=seq, return_hidden=return_hidden, inputs_embeds=embeds,
                               max_causal_keys=max_causal_keys, indexer_loss_scale=indexer_loss_scale,
                               indexer_metrics=indexer_metrics, context_parallel=context_parallel)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        if self.is_first:
            self.vision_tower.init_weights()
            self.mm_projector.init_weights()
