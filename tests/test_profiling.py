"""The [profiling] section: which trace events are communication, the step shares, the config checks, and one
2-rank gloo run of the trainer that writes the traces, tables and summaries."""

import gzip
import json

import pytest

from titan_kimi.config import ConfigError, load_job_config
from titan_kimi.training.reports.profile_summary import STEP_ANNOTATION, is_communication, summarize_trace, union_length

NO_LAUNCHER: dict[str, str] = {}


def load(*argv: str):
    return load_job_config(list(argv), environ=NO_LAUNCHER)


@pytest.mark.parametrize("name, category, device, expected", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", "cuda", True),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16", "kernel", "cuda", True),
    ("ncclDevKernel_SendRecv", "cpu_op", "cuda", False),  # only device kernels count on CUDA
    ("c10d::_allgather_base_", "cpu_op", "cuda", False),  # the host launch of an NCCL collective
    ("void at::native::vectorized_elementwise_kernel<4>", "kernel", "cuda", False),
    ("c10d::alltoall_base_", "cpu_op", "cpu", True),
    ("_c10d_functional::wait_tensor", "cpu_op", "cpu", True),
    ("gloo:all_reduce", "user_annotation", "cpu", True),
    ("_c10d_functional::_wrap_tensor_autograd", "cpu_op", "cpu", False),
    ("FSDP::all_gather_copy_out", "user_annotation", "cpu", False),
    ("aten::mm", "cpu_op", "cpu", False),
])
def test_communication_events_are_told_apart(name, category, device, expected):
    assert is_communication(name, category, device) is expected


def test_unknown_device_type_is_rejected():
    with pytest.raises(ValueError, match=r"device_type = 'mps'; valid: cuda\|cpu"):
        is_communication("aten::mm", "cpu_op", "mps")


def test_union_counts_overlaps_once_and_clips_to_the_window():
    assert union_length([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert union_length([(-5, 5), (95, 120)], 0, 100) == 10
    assert union_length([(2, 3), (0, 10)], 0, 10) == 10  # nested
    assert union_length([], 0, 10) == 0


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_cuda_step_summary_from_synthetic_trace():
    events = [_x(STEP_ANNOTATION, "user_annotation", 1000, 1000),
              _x(STEP_ANNOTATION, "gpu_user_annotation", 1050, 1000),  # the device's copy: not the window
              _x("ncclDevKernel_AllGather", "kernel", 1100, 200),
              _x("ncclDevKernel_ReduceScatter", "kernel", 1250, 100),  # overlaps the first: 250 us in all
              _x("gemm", "kernel", 1300, 400),
              _x("ncclDevKernel_AllReduce", "kernel", 1900, 300),  # half outside the step
              _x("c10d::allreduce_", "cpu_op", 1000, 900),  # a host op: not GPU communication
              {"ph": "i", "name": "marker", "ts": 1500}]
    p = summarize_trace(events, rank=1, step=20, device_type="cuda")
    assert (p.rank, p.step) == (1, 20)
    assert p.step_time_s == pytest.approx(1e-3)
    assert p.comm_s == pytest.approx(350e-6)
    assert p.cuda_busy_s == pytest.approx((600 + 100) * 1e-6)  # [1100, 1700) and [1900, 2000)
    assert p.comm_share == pytest.approx(0.35)
    assert "35.0% of the step" in p.line()


def test_cpu_step_summary_and_a_trace_without_the_step():
    events = [_x(STEP_ANNOTATION, "user_annotation", 0, 100), _x("c10d::alltoall_base_", "cpu_op", 10, 30),
              _x("gloo:all_to_all", "user_annotation", 20, 30), _x("aten::mm", "cpu_op", 0, 100)]
    p = summarize_trace(events, rank=0, step=3, device_type="cpu")
    assert p.cuda_busy_s is None and p.comm_share == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no 'titan_kimi_train_step' event"):
        summarize_trace(events[1:], rank=0, step=3, device_type="cpu")


def test_profiling_keys_are_checked():
    assert load("--profiling.enable", "true", "--profiling.steps", "3,-1").profiling.steps == [3, -1]
    with pytest.raises(ConfigError, match=r"profiling.steps = \[3\] .*nothing is profiled with profiling.enable"):
        load("--profiling.steps", "3")
    with pytest.raises(ConfigError, match=r"profiling.folder = .*nothing is profiled"):
        load("--profiling.folder", "elsewhere")
    with pytest.raises(ConfigError, match=r"step 11 is after the last one \(training.steps = 10.*1..10, or -1"):
        load("--profiling.enable", "true", "--profiling.steps", "11")
    with pytest.raises(ConfigError, match=r"profiling.steps = \[0\]"):
        load("--profiling.enable", "true", "--profiling.steps", "0")
    with pytest.raises(ConfigError, match=r"profiling.steps"):
        load("--profiling.enable", "true", "--profiling.steps", "")


@pytest.mark.slow
def test_two_gloo_ranks_write_traces_tables_and_summaries(layout_runs):
    """EP2 x FSDP2 on gloo (all-to-all, all-gather, reduce-scatter), the last of 2 steps profiled: the run
    ``profiled_ep2`` of tests/layout_runs.py, in the shared 2-rank launch."""
    layout_runs.output("profiled_ep2")
    dump = layout_runs.folder("profiled_ep2")
    folder = dump / "profiles" / "step-2"
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}.trace.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert STEP_ANNOTATION in names and "c10d::alltoall_base_" in names
        assert "aten::mm" in (folder / f"rank{rank}.kernels.txt").read_text()
        summary = json.loads((folder / f"rank{rank}.summary.json").read_text())
        assert summary["rank"] == rank and summary["step"] == 2 and summary["cuda_busy_s"] is None
        assert 0 < summary["comm_share"] <= 1 and summary["comm_s"] <= summary["step_time_s"]
        assert summary["peak_mem_gib"] > 0
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    profiles = [r["profile"] for r in rows if "profile" in r]
    assert len(profiles) == 1 and [p["rank"] for p in profiles[0]] == [0, 1]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert not (dump / "profiles" / "step-1").exists()
