"""Images in pipeline microbatches: the batch's packed patches regrouped per sample, so dim 0 is the batch.

The dataloader concatenates the patches of every image of a batch (``pixel_values [L, 3, p, p]``, ``grid_thws
[N, 3]``), which the pipeline schedule cannot split into microbatches (it splits every first-stage input along
dim 0). ``ImageSlots.pad`` gives each sample a fixed number of patch and image slots, zero-filled past its own
(``[B, max_patches, 3, p, p]``, ``[B, max_images, 3]``; a zero grid row is an empty slot); ``unpad`` turns a
microbatch of those back into the packed form the tower reads. The slot counts are fixed for the run (the
largest sample of the run's datasets), so the first stage's input shapes are static.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSlots:
    placeholder_id: int  # one placeholder token per image in input_ids
    max_images: int  # image slots per sample
    max_patches: int  # patch slots per sample (all its images)

    @classmethod
    def for_datasets(cls, placeholder_id: int, datasets: Iterable) -> "ImageSlots":
        """Slots for the largest sample of ``datasets`` (each has ``image_bounds() -> (images, patches)``)."""
        bounds = [d.image_bounds() for d in datasets]
        if not bounds:
            raise ValueError("ImageSlots.for_datasets needs at least one image-text dataset")
        return cls(placeholder_id, max(b[0] for b in bounds), max(b[1] for b in bounds))

    def pad(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
            grid_thws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixels [B, max_patches, 3, p, p], grids [B, max_images, 3])`` of a batch whose images are packed in
        sample order (the order of the placeholders in ``input_ids [B, U]``)."""
        B = input_ids.shape[0]
        images_per_row = (input_ids == self.placeholder_id).sum(1)
        n_images = grid_thws.shape[0]
        if int(images_per_row.sum()) != n_images:
            raise ValueError(f"input_ids hold {int(images_per_row.sum())} image placeholder(s) (token id "
                             f"{self.placeholder_id}) but the batch has {n_images} image(s)")
        if n_images and int(images_per_row.max()) > self.max_images:
            raise ValueError(f"a sample holds {int(images_per_row.max())} images, more than the run's "
                             f"{self.max_images} image slot(s) per sample")
        device = grid_thws.device  # the batch's tensors share one device
        patches = grid_thws.prod(1).to(device)
        rows = torch.repeat_interleave(torch.arange(B, device=device), images_per_row.to(device))
        patches_per_row = torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, rows, patches)
        if B and int(patches_per_row.max()) > self.max_patches:
            raise ValueError(f"a sample has {int(patches_per_row.max())} image patches, more than the run's "
                             f"{self.max_patches} patch slots per sample")
        if int(patches.sum()) != pixel_values.shape[0]:
            raise ValueError(f"grid_thws describe {int(patches.sum())} patches but pixel_values has "
                             f"{pixel_values.shape[0]}")
        grids = grid_thws.new_zeros(B, self.max_images, 3)
        first_image = torch.cumsum(images_per_row.to(device), 0) - images_per_row.to(device)
        grids[rows, torch.arange(n_images, device=device) - first_image[rows]] = grid_thws.to(device)
        pixels = pixel_values.new_zeros(B, self.max_patches, *pixel_values.shape[1:])
        patch_rows = torch.repeat_interleave(rows, patches)
        first_patch = torch.cumsum(patches_per_row, 0) - patches_per_row
        slots = torch.arange(pixel_values.shape[0], device=device) - first_patch[patch_rows]
        pixels[patch_rows, slots] = pixel_values
        return pixels, grids


def unpad_images(pixels: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed ``(pixel_values [L, 3, p, p], grid_thws [N, 3])`` of ``ImageSlots.pad``'s per-sample slots (of
    a whole batch or a microbatch), in sample then image order."""
    used = grids[..., 0] > 0  # t >= 1 for every real image
    grid_thws = grids[used]
    patches_per_row = (grids.prod(-1) * used).sum(1)
    in_use = torch.arange(pixels.shape[1], device=pixels.device) < patches_per_row.to(pixels.device)[:, None]
    return pixels[in_use], grid_thws
