"""The rank-slice benchmark: the routed rows an EP rank receives, the local dispatch against the model's own
MoE, and a tiny end-to-end run whose table the step-time estimate then reads."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.models.kimi_k3.moe import LatentMoE
from titan_kimi.parallel.rank_slice.expert_load import ExpertLoad, balanced_load, parse_load, zipf_load
from titan_kimi.parallel.rank_slice.local_experts import localize_experts

ROOT = Path(__file__).resolve().parents[1]


def test_expert_loads():
    even = balanced_load(tokens=4096, top_k=16, num_experts=896, ep=32)
    assert even.counts.shape == (32, 28) and even.rows == 4096 * 16 and even.rank_factor == 1.0
    hot = zipf_load(4096, 16, 896, 32, exponent=0.3)
    assert hot.rank_factor > 1.2 and hot.expert_factor > hot.rank_factor  # the busiest rank, its hottest expert
    assert int(hot.counts.sum(0).max()) <= 4096 * 32  # an expert gets at most one row per token of all ranks
    assert zipf_load(4096, 16, 896, 32, exponent=0.0).rank_factor == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="valid: balanced, zipf"):
        parse_load("uniform", 4096, 16, 896, 32)
    with pytest.raises(ValueError, match="do not split over 3 EP ranks"):
        balanced_load(4096, 16, 896, 3)


def test_measured_load_file(tmp_path):
    counts = [1.0] * 8
    counts[0] = 9.0  # expert 0 (on rank 0 of 2) takes 9 / 16 of the rows
    path = tmp_path / "load.json"
    path.write_text(json.dumps(counts))
    load = parse_load(f"file:{path}", tokens=64, top_k=2, num_experts=8, ep=2)
    assert load.rows == round(64 * 2 * 2 * 12 / 16) and load.rank_factor == pytest.approx(1.5)


def holding(moe: LatentMoE) -> torch.nn.Module:
    """A model stand-in whose one layer holds ``moe`` (what ``localize_experts`` walks)."""
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].moe_enabled, holder.layers["0"].moe = True, moe
    return holder


def assert_same_output_and_input_gradient(ref: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> None:
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    g = torch.randn_like(ref)
    (grad_ref,) = torch.autograd.grad(ref, x, g)
    (grad_out,) = torch.autograd.grad(out, x, g)
    assert ((grad_out - grad_ref).norm() / grad_ref.norm()).item() < 1e-5


def test_local_dispatch_matches_the_moe_when_it_receives_its_own_rows():
    """With one EP rank receiving exactly the rows it routed, the local dispatch (torchtitan's permutation and
    alignment, the expert-shard forward, the unpermutation) computes the MoE's own output and gradients."""
    torch.manual_seed(0)
    args = model_args_for("k31_debug")
    moe = LatentMoE(args)
    moe.init_weights()
    local = copy.deepcopy(moe)
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    with torch.no_grad():
        _, indices = moe.router(x.view(-1, args.dim))
    counts = torch.bincount(indices.view(-1), minlength=args.num_experts).view(1, -1)
    localize_experts(holding(local), ExpertLoad(counts, "measured", 1.0, 1.0))
    assert_same_output_and_input_gradient(moe(x), local(x), x)


def test_hierarchical_stand_in_matches_the_moe_when_it_receives_its_own_rows():
    """The hierarchical dispatch's stand-in (its (token, node) pairs, the relay's sort and weighted sums, the
    token's sum over nodes; the node level's rows through the local exchange) computes the MoE's own output and
    gradients, padding tokens included, when the node level receives exactly the relay's present choices and
    the experts of one local index share their weights (the relay runs a node-local id's rows on that local
    index's expert)."""
    torch.manual_seed(1)
    args = model_args_for("k31_debug")
    E, ep, node_size = args.num_experts, 4, 2
    local, nodes = E // ep, ep // node_size
    moe = LatentMoE(args)
    moe.init_weights()
    with torch.no_grad():
        for w in (moe.experts.w13, moe.experts.w2):
            w.copy_(w[torch.arange(E) % local])
    stand_in = copy.deepcopy(moe)
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    is_real = torch.ones(32, dtype=torch.bool)
    is_real[12:16] = is_real[27:] = False
    with torch.no_grad():
        _, indices = moe.router(x.view(-1, args.dim))
    node_local = (indices % (E // nodes))[is_real]  # node rank * local + local index
    counts = torch.zeros(node_size, nodes, local, dtype=torch.int64)
    counts[:, 0] = torch.bincount(node_local.view(-1), minlength=E // nodes).view(node_size, local)
    (exchange,) = localize_experts(holding(stand_in), ExpertLoad(counts.view(ep, local), "measured", 1.0, 1.0),
                                   node_size=node_size)
    assert exchange.sources == node_size and type(stand_in.experts).__name__.startswith("LocalNodeDispatch")
    assert_same_output_and_input_gradient(moe(x, is_real), stand_in(x, is_real), x)


def test_hierarchical_stand_in_refuses_nodes_that_do_not_split_the_group():
    args = model_args_for("k31_debug")
    load = balanced_load(tokens=32, top_k=args.num_experts_per_tok, num_experts=args.num_experts, ep=4)
    with pytest.raises(ValueError, match="over nodes of 3 ranks: expert_parallel_degree 4 is not 2"):
        localize_experts(holding(LatentMoE(args)), load, node_size=3)

TINY_SLICE = ["--config", "train_configs/k31.toml", "--world-size", "4", "--warmup", "0", "--repeats", "1",
              "--steps", "1", "--loads", "balanced", "zipf:0.5", "--model.flavor", "k31_debug",
              "--model.vision_flavor", "moonvit3d_debug", "--training.seq_len", "64", "--training.local_batch_size",
              "2", "--training.global_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2",
              "--parallelism.expert_parallel_degree", "2", "--rows", "medpix:4:28x28", "--stage", "0"]


def test_timed_runs_add_into_held_gradients_or_make_them_anew():
    """``_timed`` as the layers part runs it: every backward adds into the gradients held from the previous run;
    with ``new_gradients`` each run's backward makes them anew (one backward's gradient after any number)."""
    from titan_kimi.parallel.rank_slice.measure import _timed

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x, cot = torch.randn(4, 8), torch.randn(4, 8)
    (once,) = torch.autograd.grad(layer(x), [layer.weight], cot)
    run = lambda: ([layer(x)], [cot])  # noqa: E731
    _timed(run, torch.device("cpu"), warmup=1, repeats=2)
    assert torch.allclose(layer.weight.grad, 3 * once)
    _timed(run, torch.device("cpu"), warmup=1, repeats=2, new_gradients=list(layer.parameters()))
    assert torch.equal(layer.weight.grad, once)


def test_rank_slice_benchmark_runs_and_its_table_feeds_the_estimate(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import rank_slice

    out = tmp_path / "out"
    assert rank_slice.main([*TINY_SLICE, "--out", str(out), "--parts", "layers", "profile", "stage"]) == 0
    report = json.loads((out / "rank_slice.json").read_text())
    names = {e["name"] for e in report["layers"]}
    # stage 0 of k31_debug: the dense first layer, KDA and DSA layers with MoE, the tower, the optimizer
    assert {"kda+dense, block start", "kda+moe", "dsa+moe", "attention kda", "ffn moe", "optimizer step"} <= names
    assert any(n.startswith("vision tower + projector") for n in names)
    # stage 0 holds no head: the last stage's norm and head are built alone and measured with the loss
    (head,) = [e for e in report["layers"] if e["kind"] == "head"]
    assert head["forward_ms"] > 0 and head["backward_ms"] > 0 and "built alone" in head["note"]
    blocks = [e for e in report["layers"] if e["kind"] == "block"]
    assert all(e["forward_ms"] > 0 and e["backward_ms"] > 0 and e["flops"]["forward"] > 0 for e in blocks)
    # the host's time to queue each phase beside the device's (on a CPU both clocks are the wall clock)
    assert all(0 < e["host_forward_ms"] <= e["forward_ms"] and e["host_backward_ms"] > 0 for e in blocks)
    assert "host fwd / bwd ms" in (out / "rank_slice.md").read_text()
    assert {e["load"] for e in blocks if "+moe" in e["name"]} == {"balanced", "zipf:0.5"}
    profiled = {p["name"]: p for p in json.loads((out / "profile.json").read_text())}
    assert {"kda+moe", "attention kda", "ffn moe"} <= set(profiled)
    for p in profiled.values():  # every phase was timed and its ops attributed; the experts' GEMMs found
        assert p["forward"]["wall_ms"] > 0 and p["forward"]["busy_ms"] > 0 and p["backward"]["busy_ms"] > 0
    assert profiled["ffn moe"]["forward"]["categories"]["gemm"] > 0
    assert "## kda+moe" in (out / "profile.md").read_text()
    sched = report["schedule"]
    assert set(sched["forward_ms"]) == {"0"} and sched["in_flight"] == {"0": 2}  # 1F1B stage 0 of 2: both held
    assert "## The rank's schedule" in (out / "rank_slice.md").read_text()
    # with layers left unbuilt, the schedule's MFU reads the built layers' FLOPs, not the whole stage's
    cut = tmp_path / "cut"
    assert rank_slice.main([*TINY_SLICE, "--out", str(cut), "--parts", "gradients", "stage", "--max-layers",
                            "1"]) == 0
    cut_report = json.loads((cut / "rank_slice.json").read_text())
    # the gradients part: the built block kind twice, its gradients added into held ones, then new; no table entry
    notes = [(e["name"], e["note"].split(";")[0]) for e in cut_report["gradients"]]
    assert notes == [("kda+dense, block start", "gradients added into held ones"),
                     ("kda+dense, block start", "gradients new each run (its peak holds them)")], notes
    assert "## Block kinds with their gradients added" in (cut / "rank_slice.md").read_text()
    assert not (cut / "step_time_h200.json").exists()
    built, whole = cut_report["schedule"]["model_flops"]["0"], sched["model_flops"]["0"]
    assert cut_report["schedule"]["dropped_layers"]["0"] and built["forward"] < whole["forward"]
    assert "of the built layers' FLOPs" in (cut / "rank_slice.md").read_text()

    from titan_kimi.config import load_job_config
    from titan_kimi.parallel.layout import resolve_layout
    from titan_kimi.parallel.step_time.describe import describe_step_time
    from titan_kimi.training.setup.build import model_args_from_config

    cfg = load_job_config(["--job.config_file", "train_configs/k31.toml", "--job.world_size", "4",
                           "--job.dry_run", "--job.estimate_step_time", *TINY_SLICE[TINY_SLICE.index("--model.flavor"):
                                                                                     TINY_SLICE.index("--rows")],
                           "--step_time.table", str(out / "step_time_h200.json"), "--step_time.rows", "medpix:4:28x28"])
    args = model_args_from_config(cfg)
    layout = resolve_layout(cfg, 4, args)
    from titan_kimi.training.setup.build import tokenizer_from_config, vision_args_from_config

    vision = vision_args_from_config(cfg, tokenizer_from_config(cfg, args))
    lines = describe_step_time(cfg, args, layout, vision)
    # every kind is measured (stage 1's head built alone on stage 0's rank; its block start, a KDA + MoE layer,
    # at the measured KDA + MoE rates): nothing falls back
    assert "fallback" not in lines[0] and "measured (step_time_h200.json" in lines[0]
    assert "'layers/kda+moe'" not in lines[0] and "'layers/dsa+moe'" not in lines[0]
    # the skewed load: the table's zipf:0.5 MoE rates, and the busiest rank's extra rows in FLOPs and all-to-alls
    from titan_kimi.parallel.step_time.describe import settings_from_config
    from titan_kimi.parallel.step_time.estimate import StepTimeModel

    # the table's entries were measured eager: a compiled config's estimate says so
    assert "compile.mode" not in lines[0]
    cfg.compile.mode = "default"
    assert "measured under compile.mode none, not this config's default" in describe_step_time(cfg, args, layout,
                                                                                              vision)[0]
    cfg.compile.mode = "none"
    cfg.training.routed_expert_gemm = "fp8_rowwise"  # and FP8 expert GEMMs
    assert ("measured under training.routed_expert_gemm default, not this config's fp8_rowwise"
            in describe_step_time(cfg, args, layout, vision)[0])
    cfg.training.routed_expert_gemm = "default"
    written = json.loads((out / "step_time_h200.json").read_text())["geometries"]
    records = [r for g in written.values() for sec in g.values() for rows in sec.values() for r in rows]
    assert {(r["compile"], r["expert_gemm"]) for r in records} == {("none", "default")}
    # a hierarchical layout reads the flat stand-in's MoE entries, and says so
    assert "dispatch's stand-in" not in lines[0]
    hier = load_job_config(["--job.config_file", "train_configs/k31.toml", "--job.world_size", "4",
                            "--job.dry_run", "--job.estimate_step_time",
                            *TINY_SLICE[TINY_SLICE.index("--model.flavor"):TINY_SLICE.index("--rows")],
                            "--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_gradient_sync",
                            "step", "--parallelism.expert_parallel_degree", "4", "--parallelism.expert_parallel_dispatch",
                            "hierarchical", "--parallelism.expert_parallel_node_size", "2",
                            "--training.global_batch_size", "8",
                            "--step_time.table", str(out / "step_time_h200.json"), "--step_time.rows", "medpix:4:28x28"])
    assert ("the MoE layers' times are those of the flat dispatch's stand-in (none measured under hierarchical)"
            in describe_step_time(hier, args, resolve_layout(hier, 4, args), vision)[0])
    cfg.step_time.expert_load = "skewed"
    assert "expert load skewed" in describe_step_time(cfg, args, layout, vision)[0]
    factor, load = StepTimeModel(cfg, args, vision, settings_from_config(cfg)).load_factor(layout.ep)
    assert load == "zipf:0.5" and factor > 1
    assert factor == pytest.approx(parse_load("zipf:0.5", 64, 2, 8, 2).rank_factor, rel=0.05)  # up to rounding


def test_profile_categories_name_the_kernels_of_a_k31_layer():
    """Kernel names as the H100 profiles of k31.toml's layers recorded them, each in the category the report
    attributes its time to (the first matching pattern wins, so the order of CATEGORIES matters)."""
    from titan_kimi.parallel.rank_slice.kernel_profile import category

    expected = {
        "_gather_sum_kernel": "fused kernels (ours)",
        "_gather_sum_bwd_kernel": "fused kernels (ours)",
        "_situ_glu_bwd_kernel": "fused kernels (ours)",
        "_bwd_dq_kernel": "sparse mla / indexer (triton)",
        "chunk_kda_bwd_kernel_wy_dqkg_fused": "kda (fla)",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "triton_poi_fused__to_copy_add_mul_0": "inductor fused",
        "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)": "memory (copy, cat, gather, scatter, fill)",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "eager elementwise / reduce",
    }
    assert {name: category(name) for name in expected} == expected


def test_compare_rank_slices_puts_two_runs_side_by_side(tmp_path):
    """Two runs' items with the speed-up over the first; a folder without a report is named."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import compare_rank_slices

    for name, ms in (("before", 30.0), ("after", 20.0)):
        (tmp_path / name).mkdir()
        report = {"meta": {}, "layers": [{"name": "kda+moe", "load": "balanced", "forward_ms": ms / 3,
                                          "backward_ms": 2 * ms / 3}]}
        (tmp_path / name / "rank_slice.json").write_text(json.dumps(report))
    out = tmp_path / "out"
    assert compare_rank_slices.main([f"before={tmp_path / 'before'}", f"after={tmp_path / 'after'}", "--out",
                                     str(out)]) == 0
    assert "| kda+moe | balanced | 30.00 | 20.00 (1.50x) |" in (out / "variants.md").read_text()
    with pytest.raises(SystemExit):
        compare_rank_slices.main([f"x={tmp_path / 'missing'}", "--out", str(out)])
