"""MoonViT3d tower and projector against references written here from the spec (§10.2, §10.3)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lowerings.ops.vision_attention import block_diagonal_mask, vision_attention, vision_attention_reference
from titan_kimi.models.kimi_k3.projector import PatchMergerMLP
from titan_kimi.models.kimi_k3.vision import VisionTower, merge_patches
from titan_kimi.models.kimi_k3.state_dict_adapter import hf_vision_config, vision_args_from_hf_config
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs, vision_args_for
from titan_kimi.models.kimi_k3.vision_embed import sincos_time_embedding
from titan_kimi.models.kimi_k3.vision_rope import apply_rope_2d, rope_2d_angles


def tower_and_projector(seed=0, text_dim=48, **overrides):
    torch.manual_seed(seed)
    args = vision_args_for("moonvit3d_debug", **overrides)
    tower, projector = VisionTower(args), PatchMergerMLP(args, text_dim)
    tower.init_weights()
    projector.init_weights()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in [*tower.named_parameters(), *projector.named_parameters()]:
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return args, tower, projector


def test_tower_and_merge_shapes():
    args, tower, projector = tower_and_projector()
    grids = torch.tensor([[1, 4, 6], [2, 2, 2], [1, 6, 8]])
    L = int(grids.prod(1).sum())
    merged = tower(torch.randn(L, 3, 14, 14), grids)
    assert merged.shape == (4 * 6 // 4 + 2 * 2 // 4 + 6 * 8 // 4, 4 * args.dim)  # t never multiplies the count
    assert projector(merged).shape == (merged.shape[0], 48)


def test_full_size_shapes_and_checkpoint_names():
    with torch.device("meta"):
        tower, projector = VisionTower(KimiK3VisionArgs()), PatchMergerMLP(KimiK3VisionArgs(), 7168)
    shapes = {f"vision_tower.{k}": list(v.shape) for k, v in tower.state_dict().items()}
    shapes.update({f"mm_projector.{k}": list(v.shape) for k, v in projector.state_dict().items()})
    expected = {  # spec §9.2
        "vision_tower.patch_embed.proj.weight": [1024, 3, 14, 14],
        "vision_tower.patch_embed.pos_emb.weight": [64, 64, 1024],
        "vision_tower.encoder.final_layernorm.weight": [1024],
        "mm_projector.proj.0.weight": [4096, 4096],
        "mm_projector.proj.2.weight": [7168, 4096],
        "mm_projector.post_norm.weight": [7168],
    }
    for i in range(27):
        block = f"vision_tower.encoder.blocks.{i}."
        expected.update({block + "norm0.weight": [1024], block + "norm1.weight": [1024],
                         block + "wqkv.weight": [4608, 1024], block + "wo.weight": [1024, 1536],
                         block + "mlp.fc0.weight": [4096, 1024], block + "mlp.fc1.weight": [1024, 4096]})
    assert shapes == expected


def test_rope_pairs_interleave_column_then_row():
    head_dim, theta = 16, 10000.0
    angles = rope_2d_angles([(1, 3, 5)], head_dim, theta)  # 3 rows x 5 columns
    assert angles.shape == (15, 8)
    for patch in range(15):
        row, col = divmod(patch, 5)
        for i in range(head_dim // 4):
            f = theta ** (-4 * i / head_dim)
            assert math.isclose(angles[patch, 2 * i].item(), col * f, rel_tol=1e-6, abs_tol=1e-7)  # column
            assert math.isclose(angles[patch, 2 * i + 1].item(), row * f, rel_tol=1e-6, abs_tol=1e-7)  # row
    # Every frame of a video repeats the first frame's positions.
    video = rope_2d_angles([(3, 2, 2)], head_dim, theta)
    assert torch.equal(video, rope_2d_angles([(1, 2, 2)], head_dim, theta).repeat(3, 1))


def test_rope_rotates_adjacent_pairs_as_complex_numbers():
    x = torch.randn(6, 2, 8)
    angles = torch.randn(6, 4)
    expected = torch.view_as_real(torch.view_as_complex(x.view(6, 2, 4, 2)) * torch.polar(
        torch.ones_like(angles), angles).unsqueeze(1)).view(6, 2, 8)
    assert torch.allclose(apply_rope_2d(x, angles.cos(), angles.sin()), expected, atol=1e-6)


def test_merge_order_is_row_major_windows_and_averages_frames():
    D, t, h, w = 3, 2, 4, 6
    x = torch.randn(t * h * w, D)
    merged = merge_patches(x, [(t, h, w)], (2, 2))
    frames = x.view(t, h, w, D)
    for r in range(h // 2):
        for c in range(w // 2):
            token = merged[r * (w // 2) + c].view(4, D)
            for k, (dr, dc) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
                assert torch.allclose(token[k], frames[:, 2 * r + dr, 2 * c + dc].mean(0))


def test_vision_attention_matches_per_image_reference_and_never_crosses_images():
    torch.manual_seed(1)
    lengths = [5, 1, 12, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    L = sum(lengths)
    q, k, v = (torch.randn(L, 3, 8, requires_grad=True) for _ in range(3))
    mask = block_diagonal_mask(cu, L)
    out = vision_attention(q, k, v, mask, scale=8**-0.5)
    ref = vision_attention_reference(q, k, v, cu, scale=8**-0.5)
    assert torch.allclose(out, ref, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, grads_ref):
        assert torch.allclose(g, r, atol=1e-5)
    # Changing the third image leaves every other image's output unchanged.
    v2 = v.detach().clone()
    v2[6:18] = torch.randn(12, 3, 8)
    out2 = vision_attention(q, k, v2, mask, scale=8**-0.5)
    keep = torch.ones(L, dtype=torch.bool)
    keep[6:18] = False
    assert torch.equal(out2[keep], out.detach()[keep])


# ---------------------------------------------------------------------------------------------- reference
def reference_forward(tower, projector, pixels, grid):
    """One image, written from spec §10.2-§10.3 with the checkpoint's weights: complex-number RoPE, explicit
    softmax attention, explicit window gathering."""
    sd = {k: v.double() for k, v in tower.state_dict().items()}
    args = tower.args
    t, h, w = grid
    D, H, hd = args.dim, args.n_heads, args.head_dim
    x = pixels.double().reshape(t * h * w, -1) @ sd["patch_embed.proj.weight"].reshape(D, -1).t()
    pos = sd["patch_embed.pos_emb.weight"]
    if (h, w) != tuple(pos.shape[:2]):
        pos = F.interpolate(pos.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)[0]
        pos = pos.permute(1, 2, 0)
    pos = pos.reshape(h * w, D)
    if t > 1:
        j = torch.arange(D // 2, dtype=torch.float64)
        omega = 10000.0 ** (-j / (D // 2))
        time = torch.cat([torch.sin(torch.arange(t)[:, None] * omega), torch.cos(torch.arange(t)[:, None] * omega)], 1)
        pos = (pos[None] + time[:, None]).reshape(t * h * w, D)
    x = x + pos
    # 2-D rotary: complex pair 2i turns by column * f_i, pair 2i+1 by row * f_i.
    freqs = 10000.0 ** (-4 * torch.arange(hd // 4, dtype=torch.float64) / hd)
    rows = torch.arange(h).repeat_interleave(w).double().repeat(t)
    cols = torch.arange(w).repeat(h).double().repeat(t)
    angle = torch.empty(t * h * w, hd // 2, dtype=torch.float64)
    angle[:, 0::2] = cols[:, None] * freqs
    angle[:, 1::2] = rows[:, None] * freqs
    rot = torch.polar(torch.ones_like(angle), angle)[:, None]

    def rms(v, weight, eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    eps = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None) at fp32
    for i in range(args.n_layers):
        p = f"encoder.blocks.{i}."
        qkv = rms(x, sd[p + "norm0.weight"], eps) @ sd[p + "wqkv.weight"].t()
        q, k, v = qkv.view(-1, 3, H, hd).unbind(1)
        q = torch.view_as_real(torch.view_as_complex(q.reshape(-1, H, hd // 2, 2).contiguous()) * rot).reshape(-1, H, hd)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(-1, H, hd // 2, 2).contiguous()) * rot).reshape(-1, H, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, H * hd)
        x = x + attn @ sd[p + "wo.weight"].t()
        hmid = rms(x, sd[p + "norm1.weight"], eps) @ sd[p + "mlp.fc0.weight"].t()
        gelu = 0.5 * hmid * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hmid + 0.044715 * hmid**3)))
        x = x + gelu @ sd[p + "mlp.fc1.weight"].t()
    x = rms(x, sd["encoder.final_layernorm.weight"], eps).view(t, h, w, D).mean(0)
    tokens = torch.stack([torch.cat([x[2 * r, 2 * c], x[2 * r, 2 * c + 1], x[2 * r + 1, 2 * c], x[2 * r + 1, 2 * c + 1]])
                          for r in range(h // 2) for c in range(w // 2)])
    pp = {k: v.double() for k, v in projector.state_dict().items()}
    hidden = tokens @ pp["proj.0.weight"].t()
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2))) @ pp["proj.2.weight"].t()
    return rms(hidden, pp["post_norm.weight"], projector.post_norm.eps)


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 6, 10), (3, 4, 2)])  # native grid, resized, video
def test_one_image_forward_equals_hand_written_reference(grid):
    _, tower, projector = tower_and_projector(seed=2)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 3, 14, 14)
    out = projector(tower(pixels, torch.tensor([grid])))
    ref = reference_forward(tower, projector, pixels, grid)
    assert out.shape == ref.shape
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), (out.double() - ref).abs().max()


def test_packed_images_equal_separate_runs():
    _, tower, _ = tower_and_projector(seed=3)
    grids = [(1, 4, 6), (1, 2, 2), (2, 6, 4)]
    pixels = [torch.randn(t * h * w, 3, 14, 14) for t, h, w in grids]
    packed = tower(torch.cat(pixels), torch.tensor(grids))
    alone = torch.cat([tower(p, torch.tensor([g])) for p, g in zip(pixels, grids)])
    assert torch.allclose(packed, alone, atol=1e-5)


def test_time_embedding_is_sin_then_cos():
    emb = sincos_time_embedding(3, 8)
    omega = 1 / 10000 ** (torch.arange(4) / 4)
    assert torch.allclose(emb[2], torch.cat([torch.sin(2 * omega), torch.cos(2 * omega)]))


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[1, 3, 4]]), "multiple of 2"),
    (torch.tensor([[5, 2, 2]]), "1 <= t <= 4"),
    (torch.tensor([[1, 2, 4]]), "covers 8 patches"),
])
def test_bad_grids_are_rejected(bad, message):
    _, tower, _ = tower_and_projector()
    with pytest.raises(ValueError, match=message):
        tower(torch.randn(12, 3, 14, 14), bad)


def test_vision_block_compiles_fullgraph_without_breaks_and_matches_eager():
    from lowerings.inductor.graph_breaks import count_graph_breaks

    args, tower, _ = tower_and_projector(seed=4)
    block = tower.encoder.blocks[0]
    grids = [(1, 4, 6), (1, 2, 4)]
    L = 32
    x = torch.randn(L, args.dim, requires_grad=True)
    angles = rope_2d_angles(grids, args.head_dim, args.rope_theta)
    mask = block_diagonal_mask(torch.tensor([0, 24, 32]), L)
    report = count_graph_breaks(block, x, angles.cos(), angles.sin(), mask)
    assert report.breaks == 0 and report.graphs == 1, report.reasons
    out = block(x, angles.cos(), angles.sin(), mask)
    grad = torch.autograd.grad(out.sum(), x)[0]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    out_c = compiled(x, angles.cos(), angles.sin(), mask)
    grad_c = torch.autograd.grad(out_c.sum(), x)[0]
    assert torch.allclose(out_c, out, atol=1e-6) and torch.allclose(grad_c, grad, atol=1e-5)
    # Another patch count reuses the dynamic graph.
    x2 = torch.randn(12, args.dim)
    a2 = rope_2d_angles([(1, 2, 6)], args.head_dim, args.rope_theta)
    m2 = block_diagonal_mask(torch.tensor([0, 12]), 12)
    assert torch.allclose(compiled(x2, a2.cos(), a2.sin(), m2), block(x2, a2.cos(), a2.sin(), m2), atol=1e-6)


def test_vision_args_validation_and_hf_config_round_trip():
    with pytest.raises(ValueError, match="head dim divisible by 4"):
        KimiK3VisionArgs(qkv_dim=36, n_heads=6)
    with pytest.raises(ValueError, match="unknown vision flavor"):
        vision_args_for("nope")
    args = vision_args_for("moonvit3d_debug", media_placeholder_token_id=1813)
    config = {"model_type": "kimi_k3", "vision_config": hf_vision_config(args, text_hidden_size=128)}
    assert vision_args_from_hf_config(config) == args
    assert config["vision_config"]["vt_num_hidden_layers"] == 2 and config["vision_config"]["merge_kernel_size"] == [2, 2]
    with pytest.raises(ValueError, match="merge_type"):
        vision_args_from_hf_config({"vision_config": {"merge_type": "avg"}})


def test_vision_block_compiles_with_inductor_on_cpu():
    args, tower, _ = tower_and_projector(seed=5)
    block = tower.encoder.blocks[1]
    compiled = torch.compile(block, fullgraph=True)  # inductor
    for grids in ([(1, 4, 6), (1, 2, 4)], [(1, 6, 6)]):
        L = sum(t * h * w for t, h, w in grids)
        x = torch.randn(L, args.dim, requires_grad=True)
        angles = rope_2d_angles(grids, args.head_dim, args.rope_theta)
        cu = torch.tensor([0] + [t * h * w for t, h, w in grids]).cumsum(0)
        mask = block_diagonal_mask(cu, L)
        out, ref = compiled(x, angles.cos(), angles.sin(), mask), block(x, angles.cos(), angles.sin(), mask)
        grad, grad_ref = (torch.autograd.grad(o.sum(), x)[0] for o in (out, ref))
        assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(grad, grad_ref, atol=1e-5)
