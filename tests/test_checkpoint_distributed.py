"""Two gloo ranks: FSDP2-sharded and expert-parallel (DTensor) models load their own slices from the HF
checkpoint, and CheckpointManager saves/resumes sharded model + optimizer state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from test_checkpoint_hf import build_model, empty_like_model, hf_layout, write_hf
from titan_kimi.checkpoint import CheckpointManager, load_hf_checkpoint, training_state

WORLD = 2


def _full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _fsdp(rank, path, ckpt_dir):
    reference = build_model("k3_debug", seed=41)
    hf_layout(reference, mxfp4=True)  # the reference now holds the decoded experts
    model = empty_like_model(reference)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_hf_checkpoint(model, path)
    full, want = _full(model), reference.state_dict()
    assert full.keys() == want.keys()
    for key in want:
        assert torch.equal(full[key], want[key]), key

    # Sharded save/resume of model + AdamW (state on DTensor shards).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()
    state = training_state(model, opt)
    ckpt = CheckpointManager(ckpt_dir, interval=1)
    ckpt.save(1, state)
    saved = {k: v.clone() for k, v in _full(model).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    for s in opt.state.values():
        s["exp_avg"].zero_()
    assert ckpt.load(state) == 1
    for key, value in _full(model).items():
        assert torch.equal(value, saved[key]), key
    assert all(s["exp_avg"].to_local().abs().sum() > 0 for s in opt.state.values() if s["exp_avg"].to_local().numel())


def _expert_parallel(rank, path, ckpt_dir):
    reference = build_model("k31_debug", seed=42)
    hf_layout(reference, mxfp4=True)
    model = empty_like_model(reference)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    for layer in model.layers.values():
        if layer.moe_enabled:
            ex = layer.moe.experts
            ex.w13 = torch.nn.Parameter(distribute_tensor(ex.w13.data, mesh, [Shard(0)]))
            ex.w2 = torch.nn.Parameter(distribute_tensor(ex.w2.data, mesh, [Shard(0)]))
    report = load_hf_checkpoint(model, path)
    per_rank = reference.args.num_experts // WORLD
    mine = set(range(rank * per_rank, (rank + 1) * per_rank))
    read = {int(k.split(".experts.")[1].split(".")[0]) for k in report.keys_read if ".experts." in k}
    assert read == mine, (rank, read)
    for key, value in model.state_dict().items():
        want = reference.state_dict()[key]
        if hasattr(value, "to_local"):
            assert torch.equal(value.to_local(), want[rank * per_rank : (rank + 1) * per_rank]), key
        else:
            assert torch.equal(value, want), key


def _worker(rank, fsdp_path, ep_path, ckpt_dir, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        _fsdp(rank, fsdp_path, ckpt_dir)
        _expert_parallel(rank, ep_path, ckpt_dir)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_and_expert_parallel_ranks(tmp_path):
    """One spawn for both layouts (process start-up dominates the cost)."""
    paths = []
    for flavor, seed in (("k3_debug", 41), ("k31_debug", 42)):
        reference = build_model(flavor, seed=seed)
        paths.append(str(write_hf(tmp_path / flavor, hf_layout(reference, mxfp4=True), reference.args)))
    mp.spawn(_worker, args=(*paths, str(tmp_path / "ckpt"), str(tmp_path / "store")), nprocs=WORLD)
