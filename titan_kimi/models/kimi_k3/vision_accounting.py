"""FLOPs of the vision tower and projector per step (for MFU): they run per image patch, not per text token."""

from __future__ import annotations

from collections.abc import Sequence

from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs


def vision_flops(vision: KimiK3VisionArgs, text_dim: int, grids: Sequence[tuple[int, int, int]], *,
                 tower_trained: bool, projector_trained: bool) -> float:
    """Forward (+ backward, 2x forward, where trained) FLOPs of the tower and projector on images ``grids``.

    Per patch: 2 per tower matmul weight (patch conv, wqkv, wo, fc0, fc1) plus attention within its own image
    (q.k and p.v: 4 x qkv_dim x patches of the image, per block). Per merged token: 2 per projector weight.
    """
    a = vision
    block = a.dim * 3 * a.qkv_dim + a.qkv_dim * a.dim + 2 * a.dim * a.mlp_dim
    per_patch_weights = a.n_layers * block + 3 * a.patch_size**2 * a.dim
    projector = a.merged_dim * a.merged_dim + a.merged_dim * text_dim
    kh, kw = a.merge_kernel
    tower = merged = 0.0
    for t, h, w in grids:
        n = t * h * w
        tower += n * (2 * per_patch_weights + a.n_layers * 4 * a.qkv_dim * n)
        merged += (h // kh) * (w // kw)
    return tower * (3 if tower_trained else 1) + 2 * projector * merged * (3 if projector_trained else 1)
