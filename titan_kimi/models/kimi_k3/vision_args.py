"""Arguments of the MoonViT3d vision tower and the PatchMergerMLPV2 projector (spec §1.3, §10) and their flavors
(the HF ``vision_config`` mapping is the checkpoint mapping's, ``state_dict_adapter``).

The tower's defaults are the released K3 vision config: 27 blocks of width 1024, 12 heads of 128 (q, k and v
are each 1536 wide), MLP 4096, 14-pixel patches, a learned 64 x 64 position grid, 2 x 2 merge.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MEDIA_PLACEHOLDER_TOKEN_ID = 163605


@dataclass
class KimiK3VisionArgs:
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # frames with a time embedding (t <= 4)
    n_layers: int = 27
    dim: int = 1024
    n_heads: int = 12
    qkv_dim: int = 1536  # width of each of q, k and v (n_heads x head_dim)
    mlp_dim: int = 4096
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    rope_max_grid: int = 512  # the 2-D rotary table is rope_max_grid x rope_max_grid patches
    projector_eps: float = 1e-5
    media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.merge_kernel = tuple(int(k) for k in self.merge_kernel)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"vision args: {name} = {value!r} is invalid; {valid}")

        for name in ("patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time", "n_layers", "dim",
                     "n_heads", "qkv_dim", "mlp_dim", "rope_max_grid"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "must be >= 1")
        for name in ("rope_theta", "projector_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise bad(name, getattr(self, name), "must be > 0")
        if len(self.merge_kernel) != 2 or min(self.merge_kernel) < 1:
            raise bad("merge_kernel", self.merge_kernel, "must be two integers >= 1, e.g. (2, 2)")
        if self.qkv_dim % self.n_heads:
            raise bad("qkv_dim", self.qkv_dim, f"must be a multiple of n_heads = {self.n_heads}")
        if self.head_dim % 4:
            raise bad("qkv_dim / n_heads", self.head_dim,
                      "the 2-D rotary embedding needs a head dim divisible by 4 (column and row pairs)")
        if self.dim % 2:
            raise bad("dim", self.dim, "the sin-cos time embedding needs an even width")
        if self.media_placeholder_token_id < 0:
            raise bad("media_placeholder_token_id", self.media_placeholder_token_id, "must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.qkv_dim // self.n_heads

    @property
    def merged_dim(self) -> int:
        """Width of one merged token: the kernel's sub-patches side by side (the projector input)."""
        return self.merge_kernel[0] * self.merge_kernel[1] * self.dim

    def replace(self, **changes: Any) -> "KimiK3VisionArgs":
        return dataclasses.replace(self, **changes)


# Vision flavors: the released tower (401,214,464 parameters; its projector into hidden 7168 adds 46,144,512)
# and a CPU debug tower.
_VISION_FLAVORS: dict[str, dict[str, Any]] = {
    "moonvit3d": {},
    # Trains on 2 CPU cores: 2 blocks of width 64, 2 heads of 16, a 16 x 16 position grid.
    "moonvit3d_debug": dict(n_layers=2, dim=64, n_heads=2, qkv_dim=32, mlp_dim=128,
                            pos_emb_height=16, pos_emb_width=16),
}


def vision_flavor_names() -> list[str]:
    return list(_VISION_FLAVORS)


def vision_args_for(flavor: str, **overrides: Any) -> KimiK3VisionArgs:
    """The vision args of ``flavor``, with optional field overrides."""
    if flavor not in _VISION_FLAVORS:
        raise ValueError(f"unknown vision flavor {flavor!r}; valid vision flavors: {vision_flavor_names()}")
    return KimiK3VisionArgs(**{**_VISION_FLAVORS[flavor], **overrides})
