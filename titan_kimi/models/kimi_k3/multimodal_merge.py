"""Image features into the text sequence (spec §10.4, LLaVA-style in-model expansion; project decision §16c).

``input_ids`` hold exactly one placeholder per image. Placeholder ``i`` expands to the ``n_i`` positions of its
image's features; the text after it moves right by ``n_i - 1``. Every other position keeps its own token
embedding, padding included: token id 0 is not special (§16c departs from AutoModel, which zeroes every
position whose id equals the pad id). Positions past the end of a shorter row are zero vectors with
attention mask 0 and label -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class MergedInputs:
    inputs_embeds: torch.Tensor  # [B, S, H]
    attention_mask: torch.Tensor  # [B, S] int64: 1 on text (where the input mask is 1) and image slots
    position_ids: torch.Tensor  # [B, S] int64: cumsum(mask) - 1, masked positions 1 (informational)
    image_mask: torch.Tensor  # [B, S] bool: True on image slots
    labels: torch.Tensor | None  # [B, S] int64: the input labels moved with their tokens, -100 on image slots


def expanded_positions(input_ids: torch.Tensor, is_image: torch.Tensor, tokens_per_image: torch.Tensor) -> torch.Tensor:
    """``[B, U]``: where each input position lands (an image's first slot for a placeholder)."""
    extra = torch.zeros_like(input_ids)
    extra[is_image] = tokens_per_image.to(extra.dtype) - 1  # row-major order is the images' order
    shift = torch.cumsum(extra, dim=1) - extra  # placeholders strictly before each position
    return torch.arange(input_ids.shape[1], device=input_ids.device) + shift


def merge_image_features(
    input_ids: torch.Tensor,
    text_embeds: torch.Tensor,
    image_features: torch.Tensor,
    tokens_per_image: torch.Tensor,
    placeholder_id: int,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    seq_len: int | None = None,
) -> MergedInputs:
    """Expand the placeholders of ``input_ids [B, U]`` (embedded as ``text_embeds [B, U, H]``) into
    ``image_features [sum n_i, H]`` (``tokens_per_image [N]`` rows per image, in batch then row order).

    The output length is ``seq_len`` when given (positions that land beyond it are dropped; an image that
    does not fit is an error), else the longest expanded row (spec §10.4: ``max_b(#text + sum n_i)``).
    """
    B, U = input_ids.shape
    H = text_embeds.shape[-1]
    device = input_ids.device
    tokens_per_image = torch.as_tensor(tokens_per_image, device=device, dtype=torch.int64).reshape(-1)
    is_image = input_ids == placeholder_id
    n_placeholders, n_images = int(is_image.sum()), tokens_per_image.numel()
    if n_placeholders != n_images:
        raise ValueError(
            f"input_ids hold {n_placeholders} image placeholder(s) (token id {placeholder_id}) but {n_images} "
            f"image(s) were given; each image needs exactly one placeholder"
        )
    total = int(tokens_per_image.sum())
    if image_features.shape != (total, H):
        raise ValueError(f"image_features has shape {list(image_features.shape)}; the {n_images} image(s) need "
                         f"[{total}, {H}] (tokens_per_image {tokens_per_image.tolist()})")
    new_pos = expanded_positions(input_ids, is_image, tokens_per_image)
    rows = is_image.nonzero()[:, 0]  # the row of each image, in image order
    if seq_len is not None:
        S = seq_len
    else:
        row_extra = torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, rows, tokens_per_image - 1)
        S = int((U + row_extra).max()) if B else 0

    # Image slots: image i occupies [start_i, start_i + n_i) of its row.
    starts = new_pos[is_image]
    if n_images:
        ends = starts + tokens_per_image
        if seq_len is not None and bool((ends > S).any()):
            i = int((ends > S).nonzero()[0, 0])
            raise ValueError(f"image {i} (row {int(rows[i])}) needs positions {int(starts[i])}..{int(ends[i]) - 1}, "
                             f"beyond seq_len = {S}; shorten the text or lower the image resolution")
        offsets = torch.cumsum(tokens_per_image, 0) - tokens_per_image
        within = torch.arange(total, device=device) - offsets.repeat_interleave(tokens_per_image, output_size=total)
        image_flat = (rows * S + starts).repeat_interleave(tokens_per_image, output_size=total) + within
    else:
        image_flat = torch.zeros(0, dtype=torch.int64, device=device)

    keep = ~is_image & (new_pos < S)
    row_index = torch.arange(B, device=device).unsqueeze(1).expand(B, U)
    text_flat = (row_index * S + new_pos)[keep]

    embeds = text_embeds.new_zeros(B * S, H)
    embeds = embeds.index_put((text_flat,), text_embeds[keep])
    embeds = embeds.index_put((image_flat,), image_features.to(text_embeds.dtype))

    in_mask = attention_mask.to(torch.int64) if attention_mask is not None else torch.ones_like(input_ids)
    mask = torch.zeros(B * S, dtype=torch.int64, device=device)
    mask[text_flat] = in_mask[keep]
    mask[image_flat] = 1
    image_mask = torch.zeros(B * S, dtype=torch.bool, device=device)
    image_mask[image_flat] = True
    mask = mask.view(B, S)
    position_ids = (torch.cumsum(mask, dim=1) - 1).masked_fill(mask == 0, 1)

    out_labels = None
    if labels is not None:
        out_labels = torch.full((B * S,), IGNORE_INDEX, dtype=torch.int64, device=device)
        out_labels[text_flat] = labels[keep].to(torch.int64)
        out_labels = out_labels.view(B, S)
    return MergedInputs(embeds.view(B, S, H), mask, position_ids, image_mask.view(B, S), out_labels)
