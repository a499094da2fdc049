"""The tower's patch embedding (spec §10.2 steps 1-2): a 14 x 14 convolution per patch, the learned position
grid resized bilinearly to each image's patch grid, and the fixed sin-cos time embedding for videos.

Module names are the checkpoint's: ``vision_tower.patch_embed.proj.weight [D, 3, p, p]`` and
``vision_tower.patch_embed.pos_emb.weight [64, 64, D]``. Nothing else is stored: the time embedding is a
function of the frame index, computed when a multi-frame input needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs


def sincos_time_embedding(frames: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """``[frames, dim]`` fp32: ``[sin(t w) | cos(t w)]`` with ``w_j = 10000^(-j / (dim/2))``, j < dim/2."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, device=device, dtype=torch.float64) / (dim / 2))
    angles = torch.outer(torch.arange(frames, device=device, dtype=torch.float64), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class PositionEmbedding(nn.Module):
    """The learned ``[H0, W0, D]`` grid, bilinearly resized (align_corners=False) when an image's patch grid
    is not ``H0 x W0``, plus the time embedding of each frame when ``t > 1``."""

    def __init__(self, args: KimiK3VisionArgs) -> None:
        super().__init__()
        self.max_frames = args.pos_emb_time
        self.weight = nn.Parameter(torch.empty(args.pos_emb_height, args.pos_emb_width, args.dim))

    def grid(self, h: int, w: int) -> torch.Tensor:
        """``[h*w, D]`` row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        resized = F.interpolate(self.weight.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode="bilinear",
                                align_corners=False)
        return resized.squeeze(0).permute(1, 2, 0).flatten(0, 1)

    def forward(self, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """``[sum t*h*w, D]`` for the packed patches of images with ``grids`` ``(t, h, w)``."""
        parts = []
        for t, h, w in grids:
            pos = self.grid(h, w)
            if t > 1:
                time = sincos_time_embedding(t, pos.shape[1], pos.device).to(pos.dtype)
                pos = (pos.unsqueeze(0) + time.unsqueeze(1)).flatten(0, 1)
            parts.append(pos)
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    def __init__(self, args: KimiK3VisionArgs) -> None:
        super().__init__()
        self.patch_size = args.patch_size
        self.proj = nn.Conv2d(3, args.dim, kernel_size=args.patch_size, stride=args.patch_size, bias=False)
        self.pos_emb = PositionEmbedding(args)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """``pixel_values [L, 3, p, p]`` -> ``[L, D]``."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        return x + self.pos_emb(grids).to(x.dtype)
