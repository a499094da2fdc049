"""The tower's 2-D rotary position embedding (spec §10.2 step 4).

Head dim d (128 in K3), base theta (10000): frequencies ``f_i = theta^(-4i/d)`` for ``i = 0 .. d/4 - 1``.
The head's ``d/2`` complex pairs are adjacent elements ``(x[2k], x[2k+1])``; pair ``2i`` turns by the
patch's **column** times ``f_i`` and pair ``2i+1`` by its **row** times ``f_i``. Every frame of a video
uses the same positions. Computed in fp32, applied in fp32 and cast back, as MoonViT does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rope_2d_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``[head_dim / 4]`` fp32: ``theta^(-4i/head_dim)``."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4] / head_dim)


def rope_2d_angles(
    grids: Sequence[tuple[int, int, int]], head_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    """Rotation angles ``[sum t*h*w, head_dim / 2]`` (fp32) of the packed patches of images with ``grids``
    ``(t, h, w)``, patches raster-ordered (frame, row, column) per image."""
    freqs = rope_2d_frequencies(head_dim, theta, device)
    parts = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
        # [h*w, head_dim/4, 2]: (column, row) per frequency, flattened so pair 2i is the column's
        angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).flatten(1)
        parts.append(angles.repeat(t, 1))
    return torch.cat(parts) if parts else torch.empty(0, head_dim // 2, device=device)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs of ``x [L, H, D]`` by angles with ``cos, sin [L, D/2]``."""
    L, H, D = x.shape
    pairs = x.float().view(L, H, D // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).view(L, H, D).to(x.dtype)
