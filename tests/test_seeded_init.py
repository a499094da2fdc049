"""Layout-independent initialisation: every parameter gets the same values for the same seed and name whether
the model is whole, a pipeline stage, an expert-parallel slice or FSDP2-sharded over two gloo ranks (Shard(0)
and Shard(1)); the distributions are those of the modules' own init_weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from titan_kimi.models.kimi_k3 import KimiK3Model, model_args_for
from titan_kimi.models.kimi_k3.delta_attention import DecayParams
from titan_kimi.models.kimi_k3.init_specs import _module_rule, init_specs
from titan_kimi.models.kimi_k3.short_conv import ShortConv
from titan_kimi.training.setup.seeded_init import _draw, init_weights_seeded, parameter_seed, rows_per_block

WORLD = 2
# Odd sizes (vocab 2047, 7 experts) so that FSDP2's shards are uneven, and blocks of a few rows (BLOCK_VALUES is
# patched small) so that shards cut through blocks.
ARGS = dict(n_layers=8, vocab_size=2047, num_experts=7, num_experts_per_tok=2)


def build(flavor: str = "k31_debug", layer_range=None, dtype=torch.float32) -> KimiK3Model:
    with torch.device("meta"):
        model = KimiK3Model(model_args_for(flavor, **ARGS), layer_range=layer_range)
    return model.to_empty(device="cpu").to(dtype)


def seeded(seed: int = 7, **kw) -> KimiK3Model:
    model = build(**kw)
    init_weights_seeded(model, seed)
    return model


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr("titan_kimi.training.setup.seeded_init.BLOCK_VALUES", 300)


def test_seeds_are_stable_and_blocks_depend_on_the_global_shape_only():
    assert parameter_seed(1234, "output.weight", 3) == parameter_seed(1234, "output.weight", 3)
    assert len({parameter_seed(s, n, b) for s in (1, 2) for n in ("a", "b") for b in (0, 1)}) == 8
    assert rows_per_block((7, 128, 64)) == 1  # one expert per block
    assert rows_per_block((2047, 128)) == 2 and rows_per_block((2047,)) == 2047


def test_same_seed_same_weights_and_another_seed_differs():
    a, b, c = seeded(7), seeded(7), seeded(8)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.state_dict()["output.weight"], c.state_dict()["output.weight"])


def test_a_pipeline_stage_and_an_expert_slice_get_the_full_models_values():
    full = seeded().state_dict()
    for layer_range in ((0, 4), (4, 8)):
        stage = seeded(layer_range=layer_range).state_dict()
        assert stage and all(torch.equal(v, full[k]) for k, v in stage.items())
    model = build()
    for layer in model.layers.values():  # an expert-parallel rank holding experts 2..4 as plain tensors
        if layer.moe_enabled:
            layer.moe.experts.w13 = torch.nn.Parameter(layer.moe.experts.w13[2:5].clone())
            layer.moe.experts.w2 = torch.nn.Parameter(layer.moe.experts.w2[2:5].clone())
    init_weights_seeded(model, 7, expert_range=(2, 5))
    for key, value in model.state_dict().items():
        want = full[key][2:5] if ".experts." in key else full[key]
        assert torch.equal(value, want), key


def test_bf16_parameters_are_the_fp32_draws_rounded():
    fp32, bf16 = seeded(), seeded(dtype=torch.bfloat16)
    for key, value in bf16.state_dict().items():
        assert torch.equal(value, fp32.state_dict()[key].to(torch.bfloat16)), key


@pytest.mark.parametrize("flavor", ["k3_debug", "k31_debug"])
def test_distributions_match_the_modules_init_weights(flavor):
    """Constants equal exactly; random parameters have the same mean, spread and range as init_weights gives."""
    torch.manual_seed(0)
    reference = build(flavor)
    reference.init_weights()
    ours = seeded(flavor=flavor)
    specs = init_specs(ours)
    assert set(specs) == set(dict(ours.named_parameters()))
    for key, want in reference.state_dict().items():
        got = ours.state_dict()[key]
        if not specs[key].random:
            assert torch.equal(got, want), key
            continue
        spec = specs[key]
        if spec.kind in ("uniform", "log_uniform", "trunc_normal"):  # the support, for every size
            low, high = (spec.low, spec.high) if spec.kind != "log_uniform" else (0.0, float(torch.tensor(spec.high).log()))
            assert low <= got.min().item() and got.max().item() <= high, key
        if got.numel() >= 512:  # enough values to compare the spread
            spread = want.std().item()
            assert abs(got.mean().item() - want.mean().item()) < 0.1 * spread, key
            assert got.std().item() == pytest.approx(spread, rel=0.1), key
    pad = ours.args.pad_token_id
    assert not ours.tok_embeddings.weight[pad].any() and ours.tok_embeddings.weight[pad + 1].any()
    std = ours.args.dim ** -0.5
    assert ours.output.weight.abs().max().item() <= 3 * std  # truncated at 3 std


def test_the_small_modules_rules_match_their_init_weights():
    """Modules whose parameters are too small in the debug flavors for statistics, at a size that has them."""
    torch.manual_seed(0)
    for module, name in ((DecayParams(20000, 8), "A_log"), (ShortConv(5000, 4), "weight")):
        module.init_weights()
        want = getattr(module, name).detach()
        rule = _module_rule(module, name, 0.02)
        got = _draw(rule, tuple(want.shape), 0, torch.Generator().manual_seed(1), torch.device("cpu"))
        for stat in (torch.mean, torch.std, torch.min, torch.max):
            assert stat(got).item() == pytest.approx(stat(want).item(), rel=0.05, abs=2e-3), (name, stat)


def test_a_parameter_without_a_rule_is_named():
    model = build()
    model.layers["0"].extra = torch.nn.Module()
    model.layers["0"].extra.scale = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"no initial distribution for \['layers\.0\.extra\.scale \(Module\.scale\)'\]"):
        init_weights_seeded(model, 7)


def _full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _worker(rank: int, store: str, want: dict) -> None:
    import titan_kimi.training.setup.seeded_init as si

    si.BLOCK_VALUES = 300  # the same small blocks as the single-process reference
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for placement in (Shard(0), Shard(1)):
            with torch.device("meta"):
                model = KimiK3Model(model_args_for("k31_debug", **ARGS))
            def place(p, s=placement):  # FSDP2 shards dim 1 only evenly
                return s if p.dim() > 1 and p.shape[1] % WORLD == 0 else Shard(0)

            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh, shard_placement_fn=place)
            fully_shard(model, mesh=mesh)
            assert any(p.placements == (placement,) for p in model.parameters())
            model.to_empty(device="cpu")
            init_weights_seeded(model, 7)
            full = _full(model)
            assert full.keys() == want.keys()
            for key, value in want.items():
                assert torch.equal(full[key], value), (placement, key)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_on_two_ranks_gets_the_single_process_weights(tmp_path):
    """The old whole-model-init threshold (train.py FULL_INIT_BYTES) is gone: every size goes through this path."""
    want = {k: v.clone() for k, v in seeded().state_dict().items()}
    mp.spawn(_worker, args=(str(tmp_path / "store"), want), nprocs=WORLD)
