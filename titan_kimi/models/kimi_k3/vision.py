"""MoonViT3d, the K3 vision tower (spec §10.2): patch embedding, pre-norm blocks with 2-D rotary attention
within each image, a final norm, and the 2 x 2 spatial merge with temporal mean-pooling (``sd2_tpool``).

Images travel packed: ``pixel_values [L, 3, 14, 14]`` holds every patch of every image, raster-ordered
(frame, row, column) per image, and ``grid_thws [N, 3]`` their (t, h, w) patch grids. Module names are the
checkpoint's (``vision_tower.encoder.blocks.{i}.wqkv`` ...). The blocks see static-rank tensors only and
compile with ``fullgraph=True``; the per-image work (position grids, rotary angles, the merge) runs outside.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

from lowerings.ops.vision_attention import block_diagonal_mask, vision_attention
from titan_kimi.models.kimi_k3.init_specs import InitSpec, init_declared
from titan_kimi.models.kimi_k3.state_dict_adapter import is_adapter_key
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs
from titan_kimi.models.kimi_k3.vision_embed import PatchEmbed
from titan_kimi.models.kimi_k3.vision_rope import apply_rope_2d, rope_2d_angles

Grid = tuple[int, int, int]


class VisionRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (eps None = the input dtype's machine epsilon) with its weight in the input's dtype, so fp32
    master weights under bf16 autocast take the fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class VisionMLP(nn.Module):
    """``fc1(GELU_tanh(fc0(x)))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """``h += wo(attn(rope(wqkv(norm0(h)))))``; ``h += mlp(norm1(h))``. Norms are ``nn.RMSNorm`` with
    eps = None (the dtype's machine epsilon), as in the checkpoint's tower."""

    def __init__(self, args: KimiK3VisionArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.norm0 = VisionRMSNorm(args.dim, eps=None)
        self.norm1 = VisionRMSNorm(args.dim, eps=None)
        self.wqkv = nn.Linear(args.dim, 3 * args.qkv_dim, bias=False)  # rows [q | k | v], each heads x head_dim
        self.wo = nn.Linear(args.qkv_dim, args.dim, bias=False)
        self.mlp = VisionMLP(args.dim, args.mlp_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x [L, D]``; ``cos, sin [L, head_dim/2]``; ``mask [1, 1, L, L]`` block-diagonal over images."""
        L = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(L, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        attn = vision_attention(q, k, v, mask, scale=self.scale)
        x = x + self.wo(attn.reshape(L, self.n_heads * self.head_dim))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, args: KimiK3VisionArgs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.n_layers))
        self.final_layernorm = VisionRMSNorm(args.dim, eps=None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for tensor in (x, cos, sin):  # the patch count changes batch to batch: no recompile per count
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(mask, 2)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grids: Sequence[Grid], kernel: tuple[int, int]) -> torch.Tensor:
    """``sd2_tpool``: each image's ``[t*h*w, D]`` -> ``[(h/kh)(w/kw), kh*kw*D]``: a token per kh x kw window,
    its sub-patches side by side in raster order ((0,0), (0,1), (1,0), (1,1)), averaged over frames."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start : start + t * h * w]
        start += t * h * w
        windows = seq.view(t, h // kh, kh, w // kw, kw, x.shape[-1]).permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        out.append(windows.reshape((h // kh) * (w // kw), kh * kw * x.shape[-1]))
    return torch.cat(out)


class VisionTower(nn.Module):
    """``(pixel_values [L, 3, p, p], grid_thws [N, 3])`` -> merged features ``[sum_i (h_i/kh)(w_i/kw), kh*kw*D]``,
    images in order."""

    def __init__(self, args: KimiK3VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.encoder = VisionEncoder(args)

    def grids(self, grid_thws: torch.Tensor, num_patches: int) -> list[Grid]:
        """``grid_thws`` as Python ints, checked against the tower's limits and the patch count."""
        a = self.args
        if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws has shape {list(grid_thws.shape)}; expected [N, 3] rows of (t, h, w)")
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thws.tolist()]
        kh, kw = a.merge_kernel
        for i, (t, h, w) in enumerate(grids):
            if not (1 <= t <= a.pos_emb_time and h >= 1 and w >= 1 and h % kh == 0 and w % kw == 0):
                raise ValueError(
                    f"grid_thws[{i}] = {(t, h, w)} is invalid; valid: 1 <= t <= {a.pos_emb_time}, h a positive "
                    f"multiple of {kh}, w a positive multiple of {kw}"
                )
            if max(h, w) > a.rope_max_grid:
                raise ValueError(f"grid_thws[{i}] = {(t, h, w)} exceeds the {a.rope_max_grid}-patch rotary table")
        total = sum(t * h * w for t, h, w in grids)
        if total != num_patches:
            raise ValueError(f"grid_thws covers {total} patches but pixel_values holds {num_patches}")
        return grids

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        a = self.args
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, a.patch_size, a.patch_size):
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; expected [L, 3, {a.patch_size}, "
                             f"{a.patch_size}]")
        grids = self.grids(grid_thws, pixel_values.shape[0])
        x = self.patch_embed(pixel_values, grids)
        angles = rope_2d_angles(grids, a.head_dim, a.rope_theta, x.device)
        lengths = torch.tensor([0] + [t * h * w for t, h, w in grids], device=x.device)
        mask = block_diagonal_mask(torch.cumsum(lengths, 0), x.shape[0])
        x = self.encoder(x, angles.cos(), angles.sin(), mask)
        return merge_patches(x, grids, a.merge_kernel)

    def init_weights(self) -> None:
        init_declared(self)

    def parameter_init_specs(self) -> dict[str, InitSpec]:
        """Every parameter's initial distribution, by name (``init_weights`` and the seeded initialiser draw from
        it): norms 1, the rest N(0, init_std)."""
        return vision_init_specs(self, self.args.init_std)


def vision_init_specs(module: nn.Module, std: float) -> dict[str, InitSpec]:
    """RMSNorm weights 1; every other parameter (linears, the patch convolution, the position grid) N(0, std).
    LoRA factors are left to their adapters, which declare them."""
    norms = {name for name, m in module.named_modules() if isinstance(m, nn.RMSNorm)}
    return {name: InitSpec("constant", value=1.0) if name.rsplit(".", 1)[0] in norms else InitSpec("normal", std=std)
            for name, _ in module.named_parameters() if not is_adapter_key(name)}
