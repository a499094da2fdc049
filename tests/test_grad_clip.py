"""The multi-tensor gradient norm and clip against torch.nn.utils.clip_grad_norm_."""

import pytest
import torch
import torch.distributed as dist

from titan_kimi.training.optim.grad_clip import clip_gradients

SHAPES = [(7, 5), (33,), (4, 3, 2), (64, 16), (3,)]


def named(dtypes, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, dtype) in enumerate(zip(SHAPES, dtypes)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        out.append((f"p{i}", p))
    return out


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a norm under the threshold
def test_clip_equals_torch_clip_grad_norm(max_norm):
    ours = named([torch.float32] * len(SHAPES))
    ours[2][1].grad = None  # a parameter without a gradient
    theirs = named([torch.float32] * len(SHAPES))
    theirs[2][1].grad = None
    result = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_([p for _, p in theirs], max_norm, foreach=True)
    assert result.finite and result.grad_norm == pytest.approx(expected.item(), rel=1e-6)
    for (_, a), (_, b) in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_bf16_gradients_are_normed_in_fp32_and_stay_bf16():
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    ours = named(dtypes, scale=10.0)
    exact = torch.cat([p.grad.double().reshape(-1) for _, p in ours]).norm().item()
    result = clip_gradients(ours, 1.0)
    assert result.grad_norm == pytest.approx(exact, rel=1e-6)  # fp32 accumulation over exact bf16 values
    assert [p.grad.dtype for _, p in ours] == dtypes
    clipped = torch.cat([p.grad.double().reshape(-1) for _, p in ours]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-2)


def test_nonfinite_gradients_are_left_as_they_were_and_named():
    ours = named([torch.float32] * len(SHAPES))
    ours[3][1].grad[0, 0] = float("nan")
    before = [p.grad.clone() for _, p in ours]
    result = clip_gradients(ours, 0.1)
    assert not result.finite and result.report == "p3"
    for (_, p), b in zip(ours, before):
        torch.testing.assert_close(p.grad, b, equal_nan=True, rtol=0, atol=0)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_norm_over_their_mesh_like_plain_tensors(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))  # HSDP's 2-D layout
    plain = named([torch.float32] * len(SHAPES))
    sharded = named([torch.float32] * len(SHAPES))
    for _, p in sharded[:3]:
        p.grad = distribute_tensor(p.grad, mesh, [Replicate(), Shard(0)])
    expected = clip_gradients(plain, 0.5)
    result = clip_gradients(sharded, 0.5)
    assert result.grad_norm == pytest.approx(expected.grad_norm, rel=1e-6)
    for (_, a), (_, b) in zip(sharded, plain):
        got = a.grad.full_tensor() if hasattr(a.grad, "full_tensor") else a.grad
        torch.testing.assert_close(got, b.grad, rtol=1e-6, atol=0)


def test_norm_of_fsdp_and_hsdp_shards_on_two_ranks():
    """The local squares of sharded gradients are summed over the mesh dims that shard them and not over the
    replicate dim (which would count HSDP replicas twice)."""
    from tests.test_parallel import launch

    out = launch(["tests/grad_clip_worker.py"], nproc=2, timeout=300)
    assert {line.split()[1] for line in out.splitlines() if line.startswith("CLIP_OK")} == {
        "fsdp2", "hsdp2x1", "hsdp1x2"}, out
