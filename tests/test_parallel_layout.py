"""Layouts are checked before any work starts: the stage planner, schedules, microbatches, expert counts."""

import dataclasses

import pytest

from titan_kimi.config.sections import JobConfig
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.parallel.pipeline_plan import plan_pipeline


def job(local_batch_size: int = 1, seq_len: int = 4096, **parallelism) -> JobConfig:
    """The default config with these parallelism keys, a local batch and a sequence length (global batch -1)."""
    cfg = JobConfig()
    cfg.parallelism = dataclasses.replace(cfg.parallelism, **parallelism)
    cfg.training = dataclasses.replace(cfg.training, local_batch_size=local_batch_size, global_batch_size=-1,
                                       seq_len=seq_len)
    return cfg


K3 = model_args_for("k3")


def test_k3_stage_split_follows_the_attn_res_blocks():
    assert plan_pipeline(n_layers=93, block_size=12, pp=8, schedule="1F1B").ranges == (
        (0, 12), (12, 24), (24, 36), (36, 48), (48, 60), (60, 72), (72, 84), (84, 93))
    assert plan_pipeline(n_layers=93, block_size=12, pp=2, schedule="1F1B").ranges == ((0, 48), (48, 93))
    # 8 blocks over 3 stages: the earlier stages take the extra blocks.
    assert plan_pipeline(n_layers=93, block_size=12, pp=3, schedule="GPipe").ranges == ((0, 36), (36, 72), (72, 93))
    assert plan_pipeline(n_layers=93, block_size=12, pp=2, schedule="1F1B", split=[24]).ranges == ((0, 24), (24, 93))


def test_virtual_stages_are_placed_by_the_schedule():
    looped = plan_pipeline(n_layers=8, block_size=2, pp=2, schedule="Interleaved1F1B")
    assert looped.ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert looped.stages_of_rank(0) == [0, 2] and looped.stages_of_rank(1) == [1, 3]
    v = plan_pipeline(n_layers=8, block_size=2, pp=2, schedule="ZBVZeroBubble")
    assert v.stages_of_rank(0) == [0, 3] and v.stages_of_rank(1) == [1, 2]
    assert v.describe()[3] == "stage 3: layers [6, 8) on pp rank 0"


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=16, schedule="1F1B"), r"16 stages, but the model's 93 layers are 8 AttnRes blocks of 12 layers .*"
                                   r"valid: at most 8 stages"),
    (dict(pp=8, schedule="Interleaved1F1B"), r"pipeline_parallel_degree = 8 with 2 stage\(s\) per rank "
                                             r"\(Interleaved1F1B\) is 16 stages"),
    (dict(pp=2, schedule="1F1B", stages_per_rank=2), r"1F1B runs one stage per rank; valid: 0 or 1"),
    (dict(pp=2, schedule="ZBVZeroBubble", stages_per_rank=3), r"exactly 2 stages on each rank"),
    (dict(pp=2, schedule="Interleaved1F1B", stages_per_rank=1), r"needs at least 2 stages per rank"),
    (dict(pp=2, schedule="1F1B", split=[30]), r"\[30\] cut\(s\) an AttnRes block; valid: multiples of 12"),
    (dict(pp=2, schedule="1F1B", split=[24, 48]), r"names 3 stages, but .* is 2; valid: 1 increasing"),
    (dict(pp=3, schedule="1F1B", split=[48, 24]), r"not strictly increasing inside \(0, 93\)"),
    (dict(pp=2, schedule="Bogus"), r"pipeline_parallel_schedule = 'Bogus'; valid: \['1F1B'"),
])
def test_impossible_pipelines_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_pipeline(n_layers=93, block_size=12, **kwargs)


@pytest.mark.parametrize("world, changes, local_batch, message", [
    (256, dict(pipeline_parallel_degree=8, expert_parallel_degree=3), 8,
     r"parallelism.expert_parallel_degree = 3: does not divide the number of routed experts \(896\); valid: a "
     r"divisor of 896"),
    (64, dict(pipeline_parallel_degree=8, expert_parallel_degree=16), 8,
     r"parallelism.expert_parallel_degree = 16: does not divide data_parallel_shard_degree \(8\) \* "
     r"context_parallel_degree \(1\) = 8, the ranks experts are spread over; valid: a divisor of 8"),
    (16, dict(pipeline_parallel_degree=2), 1,
     r"training.local_batch_size = 1: / pipeline_parallel_microbatch_size 1 = 1 microbatches, but 1F1B over 2 "
     r"stages needs at least 2; valid: local_batch_size >= 2"),
    (16, dict(pipeline_parallel_degree=2, pipeline_parallel_microbatch_size=3), 4,
     r"parallelism.pipeline_parallel_microbatch_size = 3: does not divide training.local_batch_size = 4; valid: "
     r"a divisor of 4"),
    (16, dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="DualPipeV"), 2,
     r"DualPipeV over 4 stages needs at least 4"),
    (16, dict(pipeline_parallel_split=[12]), 2, r"pipeline_parallel_split = \[12\]: needs pipeline_parallel_degree > 1 "
                                                 r"\(parallelism.pipeline_parallel_degree = 1\); valid: \[\]"),
    (16, dict(data_parallel_replicate_degree=16), 2, r"parallelism.data_parallel_replicate_degree = 16: with "
                                                     r"data_parallel_shard x context_parallel = 1: replication alone "
                                                     r"\(DDP\) is not built; valid: shard instead"),
    (16, dict(data_parallel_shard_degree=4), 2, r"parallelism.data_parallel_shard_degree = 4: times the other degrees "
                                                r"\(1\) is 4, not the world size 16 \(job.world_size\); valid: -1 or 16"),
])
def test_impossible_layouts_are_rejected(world, changes, local_batch, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(job(local_batch, **changes), world, K3)


def test_seeds_full_scale_layout_resolves():
    layout = resolve_layout(job(8, pipeline_parallel_degree=8, expert_parallel_degree=32), 256, K3)
    assert (layout.dp_shard, layout.fsdp, layout.efsdp, layout.pipeline.num_stages) == (32, 32, 1, 8)
    assert "ep 32 x efsdp 1" in layout.describe() and "1F1B, 8 stages" in layout.describe()


def test_lr_schedule_state_resumes_into_another_grouping_of_parameters():
    """The schedule's state is its position; the learning rates are recomputed for however many parameter
    groups the resumed layout's optimizers have."""
    import torch

    from titan_kimi.training.optim.optimizer import SchedulerParts, lr_lambda

    def parts(groups):
        opts = [torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))]} for _ in range(groups)], lr=0.1)]
        rule = lambda step: lr_lambda(step, total=10, warmup=2, decay_ratio=-1, decay_type="linear", min_lr_factor=0)
        return SchedulerParts([torch.optim.lr_scheduler.LambdaLR(o, rule) for o in opts])

    two = parts(2)
    for _ in range(4):
        two.step()
    one = parts(1)
    one.load_state_dict(two.state_dict())
    assert one.get_last_lr() == [two.get_last_lr()[0]]
    assert one.schedulers[0].optimizer.param_groups[0]["lr"] == two.schedulers[0].optimizer.param_groups[1]["lr"]
    one.step()
    two.step()
    assert one.get_last_lr()[0] == pytest.approx(two.get_last_lr()[0])


def test_context_parallel_pieces_hold_the_short_convolution_window():
    """KDA's short convolution reads 3 earlier tokens, which come from the previous piece only."""
    args = model_args_for("k3_debug")
    with pytest.raises(ValueError, match=r"training.seq_len = 16: over parallelism.context_parallel_degree = 4 "
                                         r"\(zigzag\) gives pieces of 2 tokens, shorter than the 3 .* valid: "
                                         r"seq_len >= 24"):
        resolve_layout(job(seq_len=16, context_parallel_degree=4), 4, args)
    layout = resolve_layout(job(seq_len=16, context_parallel_degree=4, context_parallel_layout="contiguous"), 4, args)
    assert "cp 4 (contiguous)" in layout.describe() and layout.fsdp == 4
    assert "cp 2 (zigzag)" in resolve_layout(job(seq_len=64, context_parallel_degree=2), 4, args).describe()
