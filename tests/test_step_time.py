"""The step-time model's arithmetic: schedule orders and bubbles, in-flight microbatches, communication costs,
the measured table's lookups, and the dry run's estimate and recommendation."""

import json
import re

import pytest
import torch

from tests.test_train import TINY, run_main
from titan_kimi.parallel.pipeline_plan import plan_pipeline
from titan_kimi.parallel.step_time.comm import Network, ep_all_to_all_bytes, nodes_per_token
from titan_kimi.parallel.step_time.schedules import StageTimes, peak_in_flight, rank_orders, simulate
from titan_kimi.parallel.step_time.table import Table, merge_entries


def plan(schedule, pp, layers=96):
    return plan_pipeline(n_layers=layers, block_size=12, pp=pp, schedule=schedule)


@pytest.mark.parametrize("pp,n", [(8, 8), (4, 8), (2, 6)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, n):
    """Equal stages: every rank idles (p - 1)(F + B) of a span (m + p - 1)(F + B) (7/15 at the recipes' 8 x 8)."""
    p = plan("1F1B", pp)
    line = simulate(p, n, {s: StageTimes(1.0, 1.5, 0.5) for s in range(pp)})
    assert line.makespan == pytest.approx((n + pp - 1) * 3.0)
    for r in range(pp):
        assert line.idle(r) / line.makespan == pytest.approx((pp - 1) / (n + pp - 1))
    # 1F1B's warm-up: rank r holds min(n, pp - r) microbatches' activations, as torch's Schedule1F1B runs it
    orders = rank_orders(p, n)
    assert [peak_in_flight(orders[r])[r] for r in range(pp)] == [min(n, pp - r) for r in range(pp)]


def test_interleaving_divides_the_bubble_and_zero_bubble_schedules_shrink_it_further():
    """Interleaved 1F1B over v = 2 chunks: bubble (p - 1)(t_f + t_b) / v (Narayanan et al.); the zero-bubble
    V schedules fill most of the rest with weight gradients. Same total work on 4 ranks, 8 microbatches."""
    pp, n = 4, 8
    chunk = StageTimes(0.5, 0.5, 0.5)  # a rank's two chunks: t_f = 1, t_b = 2 per microbatch
    spans = {s: simulate(plan(s, pp), n, {i: chunk for i in range(2 * pp)}).makespan
             for s in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")}
    work = n * 2 * 1.5
    assert spans["Interleaved1F1B"] == pytest.approx(work + (pp - 1) * 3.0 / 2)
    assert spans["ZBVZeroBubble"] < spans["Interleaved1F1B"] and spans["DualPipeV"] < spans["Interleaved1F1B"]
    one = simulate(plan("1F1B", pp), n, {i: StageTimes(1.0, 1.0, 1.0) for i in range(pp)}).makespan
    assert spans["Interleaved1F1B"] < one


def test_transfers_and_a_slow_first_forward_delay_the_pipeline():
    p = plan("1F1B", 2)
    times = {s: StageTimes(1.0, 1.0, 1.0) for s in range(2)}
    base = simulate(p, 2, times).makespan
    assert simulate(p, 2, times, transfer={0: 0.25}).makespan == pytest.approx(base + 2 * 0.25)
    assert simulate(p, 2, times, first_forward={0: 0.5}).makespan == pytest.approx(base + 0.5)


def test_communication_costs():
    net = Network(nvlink_gb_per_s=400.0, internode_gb_per_s=50.0, gpus_per_node=8, latency_us=10.0)
    sent = ep_all_to_all_bytes(4096, 16, 3584)
    assert sent == 4096 * 16 * 3584 * 2  # routed rows x latent x 2 bytes
    # EP32 over 4 nodes: 24/32 of the rows leave the node through the rank's NIC, 7/32 cross NVLink
    assert net.all_to_all(sent, 32) == pytest.approx(max(sent * 24 / 32 / 50e9, sent * 7 / 32 / 400e9) + 1e-5)
    assert net.all_to_all(sent, 8) == pytest.approx(sent * 7 / 8 / 400e9 + 1e-5)  # inside one node
    assert net.all_to_all(sent, 1) == 0.0
    assert net.ring(1e9, 8) == pytest.approx(1e9 * 7 / 8 / 400e9 + 1e-5)
    # across nodes a ring leaves each node through the NICs of the group's ranks there (NCCL's channels)
    assert net.ring(1e9, 32) == pytest.approx(1e9 * 31 / 32 / min(400e9, 8 * 50e9) + 1e-5)
    assert net.ring(1e9, 16, stride=4) == pytest.approx(1e9 * 15 / 16 / (2 * 50e9) + 1e-5)  # 2 ranks a node
    assert net.ranks_per_node(12) == 4 and net.ranks_per_node(16, stride=4) == 2 and net.ranks_per_node(8, 32) == 1
    # the experts' FSDP group: one rank of each EP group, ep ranks apart
    assert net.nodes(8, stride=32) == 8 and net.nodes(4, stride=2) == 1 and net.nodes(4, stride=4) == 2
    assert net.ring(1e9, 8, stride=32) == pytest.approx(1e9 * 7 / 8 / 50e9 + 1e-5)
    assert net.ring(1e9, 4, stride=2) == pytest.approx(1e9 * 3 / 4 / 400e9 + 1e-5)
    with pytest.raises(ValueError, match="rank stride 0"):
        net.nodes(4, stride=0)
    assert net.point_to_point(1e6, 32) == pytest.approx(1e6 / 50e9 + 1e-5)
    # what each puts on the rank's NIC: the off-node share only, no latency
    assert net.nic_all_to_all(sent, 32) == pytest.approx(sent * 24 / 32 / 50e9) and net.nic_all_to_all(sent, 8) == 0
    assert net.nic_ring(1e9, 8, stride=32) == pytest.approx(1e9 * 7 / 8 / 50e9) and net.nic_ring(1e9, 8) == 0
    assert net.nic_ring(1e9, 32) == pytest.approx(1e9 * 31 / 32 / 8 / 50e9)  # 1/8 of the node's ring traffic
    assert net.nic_ring(1e9, 12) == pytest.approx(1e9 * 11 / 12 / 4 / 50e9)  # the node holding 4 of the 12
    assert net.nic_point_to_point(1e6, 32) == pytest.approx(1e6 / 50e9) and net.nic_point_to_point(1e6, 4) == 0
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        Network(0.0, 50.0, 8, 1.0)


def test_hierarchical_ep_exchange_sends_one_row_per_token_and_node():
    # K3's top-16 of 896 experts at EP32 over 4 nodes: ~3.96 nodes per token, against a sample of the routing
    torch.manual_seed(0)
    choices = torch.rand(20000, 896).topk(16, dim=-1).indices
    nodes_hit = torch.zeros(20000, 4, dtype=torch.bool).scatter_(1, choices // 224, True).sum(1).float().mean()
    assert nodes_per_token(896, 16, 4) == pytest.approx(float(nodes_hit), rel=1e-2)
    assert nodes_per_token(896, 16, 4) == pytest.approx(3.9617, abs=1e-4) and nodes_per_token(896, 1, 4) == 1.0
    net = Network(nvlink_gb_per_s=400.0, internode_gb_per_s=50.0, gpus_per_node=8, latency_us=10.0)
    sent = ep_all_to_all_bytes(4096, 16, 3584)
    across = ep_all_to_all_bytes(4096, 1, 3584) * nodes_per_token(896, 16, 4)
    # across: 3 of the 4 nodes' rows leave through the NIC; within: 7/8 of every (token, expert) row over NVLink
    assert net.nic_node_all_to_all(across, 4) == pytest.approx(across * 3 / 4 / 50e9)
    assert net.node_all_to_all(across, 4, sent, 8) == pytest.approx(across * 3 / 4 / 50e9 + sent * 7 / 8 / 400e9
                                                                    + 2e-5)
    assert net.nic_all_to_all(sent, 32) / net.nic_node_all_to_all(across, 4) == pytest.approx(4.04, abs=0.01)
    assert net.node_all_to_all(across, 1, sent, 8) == 0.0 and net.nic_node_all_to_all(across, 1) == 0.0


def test_entries_measured_with_the_padding_routed_time_the_padded_work(tmp_path):
    """Padding tokens skip the routed experts. An entry measured before (no ``padding`` key: they ran them)
    times a job on the FLOPs with the padding's expert rows (its measured time, an upper bound), not the
    smaller real work at its rate; an entry measured with them skipped is preferred and times the real work."""
    def entry(fwd_ms, **extra):
        return {"tokens": 4096, "rows": "r", "ac": 1.0, "load": "balanced", "forward_ms": fwd_ms,
                "backward_ms": 3 * fwd_ms, "forward_flops": 4e12, "backward_flops": 8e12, **extra}

    data = merge_entries(None, "g", "layers", "kda+moe", entry(4.0), hardware="NVIDIA H200", peak_flops=989e12)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    old = Table.load(path)
    # the job's real work is 3e12 / 6e12; with the padding's rows 4e12 / 8e12 (what the entry ran)
    assert old.time_ms("g", "layers", "kda+moe", 4096, 3e12, 6e12, 1.0, padded_flops=(4e12, 8e12)) == \
        pytest.approx((4.0, 12.0))
    assert old.time_ms("g", "layers", "kda+moe", 4096, 3e12, 6e12, 1.0) == pytest.approx((3.0, 9.0))
    data = merge_entries(data, "g", "layers", "kda+moe", entry(2.0, forward_flops=3e12, backward_flops=6e12,
                                                               padding="skipped"),
                         hardware="NVIDIA H200", peak_flops=989e12)
    assert len(data["geometries"]["g"]["layers"]["kda+moe"]) == 2  # both kept: they measured different work
    path.write_text(json.dumps(data))
    new = Table.load(path)
    assert new.time_ms("g", "layers", "kda+moe", 4096, 3e12, 6e12, 1.0, padded_flops=(4e12, 8e12)) == \
        pytest.approx((2.0, 6.0))


def test_table_lookups_scale_by_the_measured_rate_and_move_the_recomputed_forward(tmp_path):
    def entry(tokens, fwd_ms, bwd_ms, ac):
        return {"tokens": tokens, "rows": "r", "ac": ac, "load": "balanced", "forward_ms": fwd_ms,
                "backward_ms": bwd_ms, "forward_flops": 1e12 * tokens / 1024, "backward_flops": 2e12 * tokens / 1024}

    data = None
    for tokens, fwd in ((1024, 2.0), (4096, 4.0)):  # 0.5e12 / ms at 1024, 1e12 / ms at 4096
        data = merge_entries(data, "g", "layers", "kda+moe", entry(tokens, fwd, 3 * fwd, 1.0),
                             hardware="NVIDIA H200", peak_flops=989e12)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    table = Table.load(path)
    # at a measured point, under its own checkpointing: the measured times
    assert table.time_ms("g", "layers", "kda+moe", 4096, 4e12, 8e12, 1.0) == pytest.approx((4.0, 12.0))
    # without checkpointing the backward loses one forward
    assert table.time_ms("g", "layers", "kda+moe", 4096, 4e12, 8e12, 0.0) == pytest.approx((4.0, 8.0))
    # between the points the rate is interpolated on log tokens: 2048 is halfway
    fwd, _ = table.time_ms("g", "layers", "kda+moe", 2048, 2e12, 4e12, 0.0)
    assert fwd == pytest.approx(2e12 / 0.75e12)
    assert table.time_ms("g", "layers", "dsa+moe", 4096, 1.0, 1.0, 1.0) is None
    assert "no measured table" in Table.load(tmp_path / "absent.json").missing
    with pytest.raises(ValueError, match="this run is on cpu"):
        merge_entries(data, "g", "layers", "kda+moe", entry(512, 1.0, 1.0, 1.0), hardware="cpu", peak_flops=1.0)



def test_moe_entries_of_the_jobs_rank_come_first(tmp_path):
    """A MoE kind measured on ranks of other expert counts and dispatches: a lookup takes the entry of the job's
    local experts and dispatch, else of its dispatch, else of its local experts; an entry without a dispatch ran
    the flat one. The saved-activation lookup prefers the same way."""
    def entry(fwd_ms, local_experts, **extra):
        return {"tokens": 4096, "rows": "r", "ac": 0.0, "load": "balanced", "forward_ms": fwd_ms,
                "backward_ms": 2 * fwd_ms, "forward_flops": 1e12, "backward_flops": 2e12, "padding": "skipped",
                "checkpointing": "none", "saved_gib": fwd_ms, "local_experts": local_experts, **extra}

    data = None
    for e in (entry(1.0, 28), entry(2.0, 7), entry(3.0, 28, dispatch="hierarchical")):
        data = merge_entries(data, "g", "layers", "kda+moe", e, hardware="NVIDIA H200", peak_flops=989e12)
    assert len(data["geometries"]["g"]["layers"]["kda+moe"]) == 3  # each rank's entry kept
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    table = Table.load(path)

    def fwd(local_experts, dispatch):
        return table.time_ms("g", "layers", "kda+moe", 4096, 1e12, 2e12, 0.0, settings={"checkpointing": "none"},
                             local_experts=local_experts, dispatch=dispatch)[0]

    assert fwd(28, "flat") == pytest.approx(1.0) and fwd(7, "flat") == pytest.approx(2.0)
    assert fwd(28, "hierarchical") == pytest.approx(3.0)
    assert fwd(7, "hierarchical") == pytest.approx(3.0)  # the dispatch's local work before the expert count
    assert fwd(14, "flat") in (pytest.approx(1.0), pytest.approx(2.0))  # no expert count matches: a flat one
    assert table.saved_gib("g", "kda+moe", 4096, "none", 7, "hierarchical") == pytest.approx(3.0)
    assert table.saved_gib("g", "kda+moe", 4096, "none", 7) == pytest.approx(2.0)

STEP_TIME = [*TINY, "--job.dry_run", "--job.estimate_step_time", "--job.world_size", "8",
             "--model.flavor", "k31_debug", "--training.local_batch_size", "4", "--training.global_batch_size", "16",
             "--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
             "--activation_checkpoint.mode", "full"]


def test_dry_run_estimates_the_step_and_recommends_a_layout(capsys):
    out = run_main(capsys, *STEP_TIME, "--step_time.gpu_counts", "[8, 16]", "--step_time.top", "2")
    lines = [line for line in out.splitlines() if line.startswith("# ")]
    head = next(line for line in lines if line.startswith("# step time: "))
    assert "FLOP-rate fallback at 40% of peak" in head and "not measured" in head  # no table ships yet
    configured = next(line for line in lines if line.startswith("# step time of the configured layout: "))
    assert "pp 2 1F1B x dp_shard 4 x cp 1, ep 2, microbatch 1" in configured and "dominant" in configured
    assert any(line.startswith("# step time with Interleaved1F1B: not a valid layout") for line in lines)
    # blocks out of checkpointing hold what the table measured without checkpointing: none here, so unknown
    assert any(line.startswith("# step time of the configured layout with blocks out of checkpointing: memory "
                               "unknown (the table") and "--activation_checkpoint.mode none" in line
               for line in lines)
    for gpus in (8, 16):
        listed = [line for line in lines if line.startswith("#     ")]
        assert listed
        best = next(line for line in lines if line.startswith(f"# recommended for {gpus} GPUs: "))
        assert "tokens/s/GPU" in best
    # the fastest listed layout of 8 GPUs is the recommended one, and nothing listed is slower than what follows
    assert "# 16 GPUs at a global batch of 32 sequences (step_time.sweep_batch = per_gpu):" in lines
    block = lines[next(i for i, line in enumerate(lines) if line.startswith("# 8 GPUs at a global batch of 16")) + 2:]
    speeds = [float(line.split(" tokens/s/GPU")[0].rsplit(" ", 1)[1].replace(",", "")) for line in block[:2]]
    assert speeds == sorted(speeds, reverse=True)
    out = run_main(capsys, *STEP_TIME, "--step_time.memory_gib", "1e-9")
    assert "# recommended for 8 GPUs: none fits in 1e-09 GiB" in out


def _configured(out: str) -> tuple[float, dict[str, float]]:
    line = next(x for x in out.splitlines() if x.startswith("# step time of the configured layout: "))
    step = float(re.search(r": step ([\d.e+-]+) s,", line)[1])
    terms = re.search(r"\[(.*) s\]", line)[1]
    return step, {name: float(value) for name, value in (t.rsplit(" ", 1) for t in terms.split(", "))}


def test_mixers_checkpointing_holds_the_token_mixers_outputs_per_microbatch_in_flight(capsys):
    """Full checkpointing but for the token mixers' outputs: the same step without a measured entry of its own
    (the FLOP-rate fallback counts a whole forward again), and each layer's kept bytes more per microbatch held
    (without PP: one microbatch, every layer on the rank)."""
    from titan_kimi.config.loader import load_job_config
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.parallel.layout import resolve_layout
    from titan_kimi.parallel.step_time.describe import settings_from_config
    from titan_kimi.parallel.step_time.estimate import StepTimeModel
    from titan_kimi.parallel.step_time.kept_outputs import kept_bytes

    def estimate(*extra):
        cfg = load_job_config([*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1",
                               "--training.global_batch_size", "32", *extra],
                               environ={"WORLD_SIZE": "8"})
        args = model_args_for("k31_debug")
        model = StepTimeModel(cfg, args, None, settings_from_config(cfg))
        layout = resolve_layout(cfg, 8, args)
        return model.estimate(layout), model.works(layout, cfg.training.local_batch_size)[0], cfg

    full, _, _ = estimate()
    mixers, work, cfg = estimate("--activation_checkpoint.mode", "selective",
                                 "--activation_checkpoint.selective_ac_option", "mixers")
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    kept = sum(kept_bytes(model_args_for("k31_debug"), kind, tokens) for _, kind, _ in work.layers)
    assert kept > 0 and mixers.step_s == full.step_s
    assert (mixers.memory_gib - full.memory_gib) * 2**30 == pytest.approx(kept)
    out = run_main(capsys, *STEP_TIME, "--activation_checkpoint.mode", "selective")
    assert "activation checkpointing selective/op: its kept outputs are not modelled" in out


def test_blocks_out_of_checkpointing_skip_their_recompute_and_hold_what_they_measured():
    """``activation_checkpoint.uncheckpointed_blocks = 2``: the stage's last two layers lose their recomputed
    forward (1 ms each here) and their repeated expert exchanges, and hold the activations their entries measured
    without checkpointing; the backward meets them first, so their backward's transient and the checkpointed
    layers' recompute (after the two have freed theirs) are the two candidates for the peak."""
    import dataclasses
    from pathlib import Path

    from titan_kimi.config.loader import load_job_config
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.parallel.layout import resolve_layout
    from titan_kimi.parallel.step_time.describe import settings_from_config
    from titan_kimi.parallel.step_time.estimate import StepTimeModel
    from titan_kimi.parallel.step_time.table import geometry_key

    args = model_args_for("k31_debug")

    def config(*extra):
        return load_job_config([*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1",
                                "--training.global_batch_size", "32", *extra], environ={"WORLD_SIZE": "8"})

    cfg = config()
    layout = resolve_layout(cfg, 8, args)
    base = StepTimeModel(cfg, args, None, settings_from_config(cfg))
    work = base.works(layout, cfg.training.local_batch_size)[0]
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    layers, flops = {}, {}
    for _, kind, f in work.layers:  # each kind's entries run 1 ms per forward and 2 ms per backward of its FLOPs
        flops[kind] = f
        common = {"tokens": tokens, "rows": "r", "load": "balanced", "forward_ms": 1.0,
                  "forward_flops": f.forward, "backward_flops": f.backward}
        layers[kind] = [{**common, "ac": 1.0, "backward_ms": 3.0, "saved_gib": 0.01, "peak_gib": 0.5},
                        {**common, "ac": 0.0, "checkpointing": "none", "backward_ms": 2.0, "saved_gib": 0.2,
                         "peak_gib": 0.4}]
    table = Table({"format": 1, "geometries": {geometry_key(args): {"layers": layers}}}, Path("t.json"))

    def estimate(*extra, table=table):
        c = config(*extra)
        return StepTimeModel(c, args, None, dataclasses.replace(settings_from_config(c), table=table)).estimate(
            resolve_layout(c, 8, args))

    full, kept = estimate(), estimate("--activation_checkpoint.uncheckpointed_blocks", "2")
    assert full.terms["compute"] - kept.terms["compute"] == pytest.approx(2e-3, rel=1e-6)
    moe_kept = sum(args.is_moe_layer(layer) for layer, _, _ in work.layers[-2:])
    assert moe_kept and kept.terms["EP all-to-all"] < full.terms["EP all-to-all"]
    # + 2 x 0.2 GiB held; the peak's transient: max(0.4 - 0.2, (0.5 - 0.01) - 0.4) against 0.49
    assert kept.memory_gib - full.memory_gib == pytest.approx(0.4 + 0.2 - 0.49)
    # the dry run's search: the most blocks out that fit a limit between 2's memory and 3's
    from titan_kimi.parallel.step_time.describe import most_uncheckpointed
    three = estimate("--activation_checkpoint.uncheckpointed_blocks", "3")
    assert three.memory_gib > kept.memory_gib
    model = StepTimeModel(cfg, args, None, dataclasses.replace(settings_from_config(cfg), table=table))
    blocks, best = most_uncheckpointed(model, full, (kept.memory_gib + three.memory_gib) / 2)
    assert blocks == 2 and best.step_s == pytest.approx(kept.step_s)
    without = Table({"format": 1, "geometries": {geometry_key(args): {"layers": {
        k: rows[:1] for k, rows in layers.items()}}}}, Path("t.json"))
    missing = estimate("--activation_checkpoint.uncheckpointed_blocks", "2", table=without)
    assert missing.memory_gib is None and "--activation_checkpoint.mode none" in missing.memory_note


def test_trimmed_rows_run_at_their_real_length_and_memory_stays_sized_for_whole_rows():
    """``training.pad_to_multiple_of``: the estimate times rows of 100 real tokens at 112 of seq_len 256 (work,
    exchanges, tokens), and sizes memory for a batch whose longest row fills seq_len."""
    from titan_kimi.config.loader import load_job_config
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.parallel.layout import resolve_layout
    from titan_kimi.parallel.step_time.describe import settings_from_config
    from titan_kimi.parallel.step_time.estimate import StepTimeModel

    def estimate(multiple: str):
        cfg = load_job_config([*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1",
                               "--training.global_batch_size", "32", "--training.seq_len", "256", "--step_time.rows", "padded:100", "--training.pad_to_multiple_of", multiple],
                              environ={"WORLD_SIZE": "8"})
        args = model_args_for("k31_debug")
        model = StepTimeModel(cfg, args, None, settings_from_config(cfg))
        layout = resolve_layout(cfg, 8, args)
        return model, model.estimate(layout), model.works(layout, cfg.training.local_batch_size)[0].total.total

    whole, trimmed = estimate("0"), estimate("16")
    assert (whole[0].row_len, trimmed[0].row_len) == (256, 112)
    assert trimmed[0].real_fraction == pytest.approx(100 / 112) and whole[0].real_fraction == pytest.approx(100 / 256)
    assert trimmed[2] < 0.5 * whole[2]  # the work of 112 tokens per row, not 256
    assert trimmed[1].terms["compute"] < 0.5 * whole[1].terms["compute"]
    assert trimmed[1].memory_gib == whole[1].memory_gib


def test_dry_run_names_the_fastest_layout_with_trimmed_rows_where_rows_end_in_padding(capsys):
    rows = ("--training.seq_len", "256", "--step_time.rows", "padded:100")
    out = run_main(capsys, *STEP_TIME, *rows)
    hint = next(line for line in out.splitlines() if line.startswith("# rows hold "))
    assert hint.startswith("# rows hold 100 real tokens of 256: with --training.pad_to_multiple_of 128 "
                           "they run at 128; the configured layout ")
    # the configured PP2 layout with trimmed rows, then the fastest layout that fits with them
    assert re.search(r"the configured layout [\d.]+ s \((\d+\.\d\d)x its step\); the fastest that fits: pp ", hint)
    assert re.search(r"\(\d+\.\d\dx the configured layout's step\)$", hint)
    out = run_main(capsys, *STEP_TIME, *rows, "--parallelism.pipeline_parallel_degree", "1",
                   "--training.global_batch_size", "32", "--training.pad_to_multiple_of", "16")
    assert "# step time: rows run at 112 of 256 tokens (training.pad_to_multiple_of = 16)" in out
    assert "# rows hold" not in run_main(capsys, *STEP_TIME)  # packed rows: no padding to cut


def test_a_layers_transient_scales_from_the_measurements_nearest_in_tokens():
    """A measured peak holds parts that do not grow with the tokens: 4,096-token memory scales the 4,096-token
    entries, not a 1,152-token entry multiplied by 3.6."""
    from pathlib import Path
    from types import SimpleNamespace

    from titan_kimi.parallel.step_time.estimate import StepTimeModel

    rows = {"kda+moe": [{"tokens": 4096, "ac": 1.0, "peak_gib": 10.0}, {"tokens": 1152, "ac": 1.0, "peak_gib": 4.0},
                        {"tokens": 4096, "ac": 0.0, "peak_gib": 50.0}],
            "dsa+moe": [{"tokens": 4096, "ac": 1.0, "peak_gib": 12.0}]}
    table = Table({"format": 1, "geometries": {"g": {"layers": rows}}}, Path("t.json"))
    fake = SimpleNamespace(s=SimpleNamespace(table=table), geometry="g")
    assert StepTimeModel._transient(fake, 4096, 1.0) == 12.0
    assert StepTimeModel._transient(fake, 3072, 1.0) == 9.0  # nearer 4,096 than 1,152 on log tokens
    assert StepTimeModel._transient(fake, 1152, 1.0) == 4.0
    assert StepTimeModel._transient(fake, 4096, 0.0) == 50.0  # the entries without checkpointing
    assert StepTimeModel._transient(SimpleNamespace(s=fake.s, geometry="other"), 4096, 1.0) is None
    # what the forward left (its output; in older entries also the layer's gradients) is not transient
    rows["kda+moe"][0]["saved_gib"] = 1.5
    assert StepTimeModel._transient(fake, 4096, 1.0) == 12.0
    rows["dsa+moe"][0]["saved_gib"] = 4.0
    assert StepTimeModel._transient(fake, 4096, 1.0) == 8.5


def test_the_busiest_nic_bounds_the_step_when_compute_hides_the_gathers(capsys):
    """Without PP every microbatch gathers and reduce-scatters each FSDP unit behind compute; with every rank on
    its own node and a slow NIC, the hidden gathers, the reduce-scatters and the EP all-to-alls together take the
    NIC longer than the schedule: the step grows to the NIC's seconds, the excess named as its own term."""
    args = [*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1", "--training.global_batch_size", "32",
            "--metrics.peak_flops", "1e11", "--step_time.gpus_per_node", "1"]
    step, terms = _configured(run_main(capsys, *args, "--step_time.internode_gb_per_s", "0.3"))
    assert terms["NIC contention"] > 0 and sum(terms.values()) == pytest.approx(step, rel=0.01)
    step, terms = _configured(run_main(capsys, *args, "--step_time.internode_gb_per_s", "3"))
    assert "NIC contention" not in terms and sum(terms.values()) == pytest.approx(step, rel=0.01)


def test_memory_drops_the_accumulated_gradients_when_they_are_reduced_every_microbatch():
    """One Holding for the dry run, this estimate and the rank slice: under PP the step-end reduction keeps every
    unit's unsharded fp32 gradients (the local experts' too, at efsdp 1); microbatch sync keeps two units' in
    flight; with reshard_after_forward = always only two units stay gathered."""
    import dataclasses

    from titan_kimi.config.sections import JobConfig
    from titan_kimi.models.kimi_k3 import model_args_for
    from titan_kimi.parallel.layout import resolve_layout
    from titan_kimi.parallel.stage_params import StageParams, holding_from_config, rank_bytes

    cfg = JobConfig()
    cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16")
    cfg.training = dataclasses.replace(cfg.training, mixed_precision=False, local_batch_size=8,
                                       global_batch_size=-1, seq_len=64)
    stage = StageParams(dense=1000, dense_frozen=0, experts=64000, experts_frozen=0, fp32=0, fp32_frozen=0,
                        units=(400, 300, 300), expert_units=(32000, 32000))

    def held(pp=2, **parallelism):
        c = dataclasses.replace(cfg, parallelism=dataclasses.replace(
            cfg.parallelism, pipeline_parallel_degree=pp, expert_parallel_degree=4, **parallelism))
        layout = resolve_layout(c, 16, model_args_for("k31_debug"))
        return rank_bytes(stage, fsdp=layout.fsdp, efsdp=layout.efsdp, holding=holding_from_config(c, layout))

    step, micro = held(), held(pipeline_gradient_sync="microbatch")
    always = held(pipeline_gradient_sync="microbatch", fsdp_reshard_after_forward="always")
    # fsdp 8 = ep 4 x efsdp 2: a layer's local experts are 32000 / 4 = 8000 elements, gathered in bf16
    assert step.gathered == micro.gathered == (1000 + 2 * 8000) * 2
    assert step.gathered_grads == (1000 + 2 * 8000) * 4  # fp32, kept for the step
    assert micro.gathered_grads == always.gathered_grads == (8000 + 8000) * 4  # two units in flight
    assert always.gathered == (8000 + 8000) * 2 and step.shards == micro.shards == always.shards
    # step-end sync keeps every unit gathered from its first backward on, whatever reshard_after_forward says
    assert held(fsdp_reshard_after_forward="always").total == step.total
    # without PP: two units gathered at a time, or every unit from its forward to its backward with "never"
    assert held(pp=1).gathered == (8000 + 8000) * 2
    assert held(pp=1, fsdp_reshard_after_forward="never").gathered == (1000 + 2 * 8000) * 2


def test_dry_run_models_the_hierarchical_ep_dispatch(capsys):
    """EP4 over 2 nodes of 2 (k31_debug: top-2 of 8 experts): the flat dispatch puts half of each token's 2 rows
    on the NIC, the hierarchical one a row per other node holding one of its experts (1.571 / 2 per token); with
    NVLink and latency made negligible, the EP term shrinks by that ratio. An EP group inside one node is rejected."""
    args = [*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1", "--training.global_batch_size", "32",
            "--parallelism.expert_parallel_degree", "4", "--step_time.gpus_per_node", "2",
            "--step_time.latency_us", "0", "--step_time.nvlink_gb_per_s", "1e9",
            "--metrics.peak_flops", "1e30"]  # shared experts too fast to hide any of an exchange (test below)
    _, flat = _configured(run_main(capsys, *args))
    out = run_main(capsys, *args, "--parallelism.expert_parallel_dispatch", "hierarchical")
    assert "ep 4 (hierarchical), microbatch" in out
    _, hierarchical = _configured(out)
    ratio = hierarchical["EP all-to-all"] / flat["EP all-to-all"]
    assert ratio == pytest.approx(nodes_per_token(8, 2, 2) / 2, rel=0.02)
    with pytest.raises(ValueError, match="expert_parallel_degree 4 is not 2\\+ whole nodes of 4 ranks"):
        run_main(capsys, *args, "--parallelism.expert_parallel_dispatch", "hierarchical",
                 "--step_time.gpus_per_node", "4")


def test_hierarchical_dispatch_hides_its_rows_leg_behind_the_shared_experts(capsys):
    """The hierarchical dispatch runs the shared experts' forward while the rows cross nodes (forward and the
    recomputed forward under full AC) and their backward while the rows' gradient crosses back: with a NIC slow
    enough, every one of those passes hides the shared experts' whole time (their FLOPs at the fallback rate).
    The flat dispatch hides the shared experts' forward behind its combine, none of their backward."""
    from titan_kimi.models.kimi_k3.flavors import model_args_for
    from titan_kimi.parallel.step_time.stage_work import shared_expert_flops

    args = [*STEP_TIME, "--parallelism.pipeline_parallel_degree", "1", "--training.global_batch_size", "32",
            "--parallelism.expert_parallel_degree", "4", "--step_time.gpus_per_node", "2",
            "--step_time.internode_gb_per_s", "0.3", "--step_time.latency_us", "0"]  # a leg ~1.4x their backward
    peak = ["--metrics.peak_flops", "1e12"]
    no_time = ["--metrics.peak_flops", "1e30"]
    hier = ["--parallelism.expert_parallel_dispatch", "hierarchical"]
    _, shown = _configured(run_main(capsys, *args, *hier, *peak))
    _, unhidden = _configured(run_main(capsys, *args, *hier, *no_time))
    model = model_args_for("k31_debug")
    moe_layers = [layer for layer in range(model.n_layers) if model.is_moe_layer(layer)]
    shared = shared_expert_flops(model, moe_layers[0], 4 * 32)  # one microbatch of 4 rows x 32 tokens per rank
    assert shared.forward > 0 and shared.backward == pytest.approx(2 * shared.forward)
    rate = 0.4 * 1e12  # step_time.fallback_mfu x metrics.peak_flops
    hidden = len(moe_layers) * (2 * shared.forward + shared.backward) / rate  # forward, recompute, backward
    assert unhidden["EP all-to-all"] - shown["EP all-to-all"] == pytest.approx(hidden, rel=0.02)
    _, flat = _configured(run_main(capsys, *args, *peak))
    _, flat_unhidden = _configured(run_main(capsys, *args, *no_time))
    hidden_flat = len(moe_layers) * 2 * shared.forward / rate  # forward and recompute
    assert flat_unhidden["EP all-to-all"] - flat["EP all-to-all"] == pytest.approx(hidden_flat, rel=0.02)


def test_collectives_benchmark_sets_each_collective_beside_the_model(tmp_path):
    """scripts/bench/collectives.py on 4 gloo ranks as 2 simulated nodes of 2: every op timed, and its model
    column and bounding key are the estimate's own formulas for that size and group."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "scripts/bench/collectives.py", "--out", str(tmp_path), "--sizes-mb", "0.5", "--repeats", "2",
           "--warmup", "1", "--gpus-per-node", "2"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "collectives.json").read_text())
    net = Network(**record["network"])
    assert net.gpus_per_node == 2 and record["device"] == "CPU, gloo"
    rows = {r["op"]: r for r in record["rows"]}
    assert set(rows) == {"all_gather", "reduce_scatter", "all_to_all"}
    for op, r in rows.items():
        assert r["ranks"] == 4 and r["nodes"] == 2 and r["measured_ms"] > 0 and r["implied_gb_per_s"] > 0
        assert r["tensor_bytes"] == pytest.approx(0.5e6, rel=1e-3)
        assert r["dtype"] == ("float32" if op == "reduce_scatter" else "bfloat16")
    # rings over 2 nodes of 2: the node's 2 NICs (90 GB/s) bound them below NVLink; the all-to-all's off-node half
    for op in ("all_gather", "reduce_scatter"):
        s = rows[op]["tensor_bytes"]
        assert rows[op]["model_ms"] == pytest.approx(net.ring(s, 4) * 1e3)
        assert rows[op]["model_ms"] == pytest.approx((s * 3 / 4 / (2 * 45e9) + 25e-6) * 1e3)
        assert rows[op]["bound"] == "internode_gb_per_s"
    b = rows["all_to_all"]["tensor_bytes"]
    assert rows["all_to_all"]["model_ms"] == pytest.approx((b * 2 / 4 / 45e9 + 25e-6) * 1e3)
    assert "| all_to_all | 4 | 2 |" in (tmp_path / "collectives.md").read_text()
