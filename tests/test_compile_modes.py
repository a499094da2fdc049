"""The compile-mode registry, per-block compile in each mode, zero graph breaks, and the ablation script."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lowerings.inductor.graph_breaks import count_graph_breaks
from lowerings.inductor.modes import compile_mode, compile_mode_names, compile_options, lowering_scope
from lowerings.inductor.passes import COUNTER
from lowerings.ops.registry import emits_formula, triton_ops_enabled
from titan_kimi.config.sections import Compile
from titan_kimi.models.kimi_k3 import KimiK3Model, build_sequence_info, model_args_for
from titan_kimi.models.kimi_k3.block import KimiK3Block
from titan_kimi.parallel.compile import apply_compile

ROOT = Path(__file__).parents[1]


def load_script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / "scripts" / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_graph_breaks = load_script("check/graph_breaks.py")
ablate_compile = load_script("bench/compile_modes.py")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_every_config_choice_is_a_registered_mode():
    choices = dict((f.name, f.metadata["choices"]) for f in dataclasses.fields(Compile))["mode"]
    assert sorted(choices) == sorted(compile_mode_names())
    assert compile_options("none") is None
    for mode in compile_mode_names():
        with lowering_scope(mode):  # every mode's lowering can be entered
            pass
        if mode != "none":
            assert compile_options(mode)["backend"] == "inductor"
    max_autotune = compile_options("max-autotune")
    assert "mode" not in max_autotune  # torch's max-autotune-no-cudagraphs, spelled out with ATen-only GEMMs
    assert max_autotune["options"] == {"max_autotune": True, "coordinate_descent_tuning": True,
                                       "max_autotune_gemm_backends": "ATEN"}
    assert compile_options("reduce-overhead")["options"] == {"triton.cudagraphs": True, "graph_partition": True}
    assert compile_mode("reduce-overhead").cudagraphs and not compile_mode("default").cudagraphs
    assert "joint_custom_post_pass" in compile_options("inductor")["options"]


def test_unknown_mode_error_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"compile.mode = 'fastest' is not available; valid: \['none', 'default', "
                                         r"'inductor', 'max-autotune', 'reduce-overhead'\]"):
        compile_options("fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        ablate_compile.parse_modes("none,fastest")


def test_lowering_scope_sets_and_restores_the_flags():
    assert not triton_ops_enabled() and not emits_formula("situ_glu")
    with lowering_scope("inductor"):
        assert triton_ops_enabled() and emits_formula("situ_glu")
        with lowering_scope("default"):  # nests
            assert not triton_ops_enabled() and not emits_formula("situ_glu")
        assert emits_formula("situ_glu")
    assert not triton_ops_enabled() and not emits_formula("situ_glu")


def block_inputs(args, layer: int, seq_len: int = 16):
    torch.manual_seed(0)
    hidden = torch.randn(2, seq_len, args.dim, requires_grad=True)
    bank = torch.randn(2 * seq_len, check_graph_breaks.bank_entries(args, layer), args.dim)
    doc_ids = torch.tensor([[1] * seq_len, [1] * 5 + [2] * (seq_len - 5)])
    return hidden, bank, build_sequence_info(2, seq_len, hidden.device, doc_ids)


def lowering_groups() -> dict[tuple, list[str]]:
    """Compiled modes grouped by how they lower the ops (what Dynamo traces)."""
    groups: dict[tuple, list[str]] = {}
    for name in compile_mode_names():
        spec = compile_mode(name)
        if spec.compiled:
            groups.setdefault((spec.triton_ops, spec.graph_passes), []).append(name)
    return groups


@pytest.mark.parametrize("mode", [modes[0] for modes in lowering_groups().values()])
def test_every_block_type_has_zero_graph_breaks_in_every_mode(mode):
    # Modes in one lowering group trace the same graph; one representative per group covers them all.
    args = model_args_for("k31_debug")
    kinds = check_graph_breaks.representative_layers(args)
    assert set(kinds) == {"kda+dense", "kda+moe", "dsa+moe"}
    for kind, layer in kinds.items():
        torch.manual_seed(0)
        block = KimiK3Block(layer, args)
        block.init_weights()
        report = count_graph_breaks(block, *block_inputs(args, layer), mode=mode)
        assert (report.graphs, report.breaks) == (1, 0), (mode, kind, report.reasons)


@pytest.fixture
def no_fx_cache():
    # Inductor's FX-graph and AOT-autograd caches off: a hit would skip the lowering, and with it the mode's pass.
    # The kernels' binaries may still come from Inductor's on-disk cache: they are keyed by their source, which
    # the lowering writes after the passes. (config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes
    # config-module attributes on undo.)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("mode", ["default", "inductor", "max-autotune"])
def test_fullgraph_block_in_mode_matches_eager(mode, no_fx_cache):
    # Layer 0 (KDA + dense SiTU MLP + AttnRes): the smallest block that holds both fused ops. Compiled for
    # real (no FX-cache hit), so the inductor mode's pass runs and is counted.
    counters.clear()
    args = model_args_for("k31_debug")
    torch.manual_seed(0)
    block = KimiK3Block(0, args)
    block.init_weights()
    hidden, bank, seq = block_inputs(args, 0)
    wrt = [hidden, *block.parameters()]
    out, _ = block(hidden, bank, seq)
    grads = torch.autograd.grad(out.sum(), wrt, allow_unused=True)
    compiled = torch.compile(block, fullgraph=True, **compile_options(mode))
    with lowering_scope(mode):
        out_c, _ = compiled(hidden, bank, seq)
    grads_c = torch.autograd.grad(out_c.sum(), wrt, allow_unused=True)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    assert sum(g is not None for g in grads) > 10
    for g_c, g in zip(grads_c, grads):
        assert (g_c is None) == (g is None)
        if g is not None:
            torch.testing.assert_close(g_c, g, rtol=1e-4, atol=1e-5)
    assert counters[COUNTER]["situ_glu_rewrites"] == (1 if mode == "inductor" else 0)


def test_apply_compile_holds_the_mode_during_the_model_forward_only():
    args = dataclasses.replace(model_args_for("k31_debug"), n_layers=2, kda_layers=(), full_attn_layers=())
    torch.manual_seed(0)
    model = KimiK3Model(args)
    model.init_weights()
    apply_compile(model, "inductor", fullgraph=True)
    seen = []
    for block in model.layers.values():
        # Observe the state each compiled call runs under, then run the block eagerly (no compile here).
        def spy(*a, _block=block, **kw):
            seen.append((triton_ops_enabled(), emits_formula("situ_glu"), torch._dynamo.config.recompile_limit))
            return _block._call_impl(*a, **kw)

        block._compiled_call_impl = spy
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    model(tokens)
    limit = max(8, 8 * len(model.layers) + 8)  # compile.py: 8 variants per block (experts outside under EP)
    assert seen == [(True, True, limit)] * len(model.layers)
    assert not triton_ops_enabled() and not emits_formula("situ_glu")
    assert torch._dynamo.config.recompile_limit == 8


def test_ablation_script_writes_table_and_json(tmp_path):
    out = tmp_path / "ablate"
    argv = ["--flavor", "k31_debug", "--steps", "3", "--seq-len", "16", "--batch", "1", "--n-layers", "1",
            "--modes", "none,default", "--out", str(out), "--no-plot", "--profile", "--",
            "--training.mixed_precision", "false"]
    assert ablate_compile.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    runs = {r["mode"]: r for r in result["runs"]}
    assert list(runs) == ["none", "default"]
    assert result["setup"]["steps"] == 3 and result["setup"]["n_layers"] == 1
    eager, compiled = runs["none"], runs["default"]
    assert eager["graphs"] == 0 and eager["max_abs_dloss"] == 0
    assert compiled["graphs"] >= 1 and compiled["graph_breaks"] == 0
    assert compiled["max_abs_dloss"] < 1e-3  # fp32: the compiled steps follow the eager loss curve
    assert eager["mean_abs_dloss"] == 0 and compiled["mean_abs_dloss"] <= compiled["max_abs_dloss"]
    for r in runs.values():
        assert len(r["losses"]) == 3 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["compile_s"] >= 0
    table = (out / "results.md").read_text()
    assert "| mode | tokens/s | speed-up |" in table and "\n| default | " in table
    assert "| max \\|dloss\\| vs eager | mean \\|dloss\\| |" in table
    assert "| 1.00x |" in next(line for line in table.splitlines() if line.startswith("| none |"))
    for mode in ("none", "default"):  # --profile: one extra profiled step per mode, kernels by time
        assert "Self CPU" in (out / f"profile_{mode}.txt").read_text()
    assert result["setup"]["lr_warmup_steps"] == 0 and compiled["step1_rel_dloss"] < 1e-4
    # --replot rebuilds the table from results.json alone (e.g. after fetching it from the GPU machine)
    (out / "results.md").unlink()
    assert ablate_compile.main(["--replot", str(out), "--no-plot"]) == 0
    assert (out / "results.md").read_text() == table
    with pytest.raises(ValueError, match="no results.json"):
        ablate_compile.main(["--replot", str(tmp_path), "--no-plot"])


def test_ablation_plot_needs_matplotlib(tmp_path, monkeypatch):
    setup = {"flavor": "k31_debug", "steps": 3, "batch": 1, "seq_len": 16, "device_name": "cpu"}
    runs = [{"mode": "none", "tokens_per_s": 10.0, "step_time_s": 0.1, "compile_s": 0.0, "peak_mem_gib": 0.5},
            {"mode": "default", "tokens_per_s": 12.0, "step_time_s": 0.08, "compile_s": 9.0, "peak_mem_gib": 0.6}]
    if importlib.util.find_spec("matplotlib") is not None:
        ablate_compile.plot(tmp_path / "chart.png", setup, runs)
        assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match=r"needs matplotlib .*pip install matplotlib.*--no-plot"):
        ablate_compile.plot(tmp_path / "missing.png", setup, runs)


def test_kda_ops_are_captured_except_the_context_parallel_one():
    """The one-rank KDA ops run inside reduce-overhead's CUDA graphs (their fla backend has no host sync and takes
    fresh buffers: lowerings/kernels/fla_graph_buffers.py); the context-parallel op exchanges states between
    ranks and carries the tag that makes Inductor partition around it. Sparse MLA has fixed grids."""
    unsafe = torch._C.Tag.cudagraph_unsafe
    assert unsafe not in torch.ops.titan_kimi.kda.default.tags
    assert unsafe not in torch.ops.titan_kimi.kda_backward.default.tags
    assert unsafe in torch.ops.titan_kimi.kda_cp.default.tags
    assert unsafe not in torch.ops.titan_kimi.sparse_mla.default.tags


@pytest.mark.parametrize("frozen_embedding", [False, True])
def test_module_granularity_compiles_each_module_kind_once_and_matches_eager(frozen_embedding):
    """compile.granularity = module: a block's norms, attention and FFN compile apart, so the stack of 8 debug
    layers (KDA + dense, KDA + MoE, DSA + MoE; two AttnRes blocks) makes one graph per module kind, where
    whole-block compile makes one per block variant. Forward and backward equal eager.

    With the embedding frozen (LoRA), layer 0's input would not require grad where every later layer's does: a
    guard on requires_grad would compile its norm and attention a second time. The model makes the input
    require grad, so the module kinds still compile once."""
    args = model_args_for("k31_debug")
    torch.manual_seed(0)
    model = KimiK3Model(args)
    model.init_weights()
    if frozen_embedding:
        model.tok_embeddings.weight.requires_grad_(False)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    trained = [p for p in model.parameters() if p.requires_grad]  # the indexer is frozen
    eager = model(tokens).float()
    grads = torch.autograd.grad(eager.square().mean(), trained, allow_unused=True)
    counters.clear()
    apply_compile(model, "default", fullgraph=True, granularity="module")
    compiled = model(tokens).float()
    grads_c = torch.autograd.grad(compiled.square().mean(), trained, allow_unused=True)
    # RMSNorm (both norms of every layer: one code, one shape), KDA, DSA, the dense SiTU MLP, the MoE
    assert counters["stats"]["unique_graphs"] == 5
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    for g_c, g in zip(grads_c, grads):
        assert (g_c is None) == (g is None)
        if g is not None:
            torch.testing.assert_close(g_c, g, rtol=1e-3, atol=1e-5)
    if frozen_embedding:
        with torch.no_grad():  # no grad: nothing made to require it
            assert not model(tokens).requires_grad


def test_unknown_granularity_is_rejected():
    model = KimiK3Model(dataclasses.replace(model_args_for("k31_debug"), n_layers=2, kda_layers=(), full_attn_layers=()))
    with pytest.raises(ValueError, match="'layer' is not one of"):
        apply_compile(model, "default", fullgraph=True, granularity="layer")


def test_reduce_overhead_keeps_cuda_graphs_out_of_the_vision_tower(monkeypatch):
    """The tower's patch count changes with the images, so its blocks compile without CUDA graphs (a graph per
    new count was slower on the H200); the decoder's regions keep them."""
    from titan_kimi.models.kimi_k3.multimodal import KimiK3VLModel
    from titan_kimi.models.kimi_k3.vision_args import vision_args_for

    model = KimiK3VLModel(model_args_for("k31_debug", index_topk=8),
                          vision_args_for("moonvit3d_debug", media_placeholder_token_id=7))
    calls: dict[str, list[dict]] = {"decoder": [], "vision": []}

    def recorder(kind):
        return lambda self, **kw: calls[kind].append(kw)

    monkeypatch.setattr(KimiK3Block, "compile", recorder("decoder"))
    vision_block = type(model.vision_tower.encoder.blocks[0])
    monkeypatch.setattr(vision_block, "compile", recorder("vision"))
    for submodule in {type(m) for block in model.layers.values() for m in block.modules()} - {KimiK3Block}:
        monkeypatch.setattr(submodule, "compile", recorder("decoder"), raising=False)
    apply_compile(model, "reduce-overhead", fullgraph=True, granularity="module")
    assert calls["decoder"] and all(kw["options"]["triton.cudagraphs"] for kw in calls["decoder"])
    assert len(calls["vision"]) == len(model.vision_tower.encoder.blocks)
    assert all("triton.cudagraphs" not in kw.get("options", {}) for kw in calls["vision"])
    assert all(kw["backend"] == "inductor" and kw["fullgraph"] for kw in calls["vision"])
