"""The trainer runs of the shipped k31_debug recipe that tests/test_parallel.py and tests/test_context_parallel.py
compare and tests/test_profiling.py reads, by name (tests/train_runs.py), launched once per pytest run
(tests/conftest.py layout_runs)."""

from __future__ import annotations

from tests.test_parallel import RECIPE
from tests.train_runs import Run

# 8 steps of the shipped recipe as users type it (mixed precision on), global batch 8.
SHIPPED_STEPS = ("--training.steps", "8", "--metrics.log_freq", "100")
# fp32, 4 steps of 64 tokens, a checkpoint every 2 steps: the resume tests' runs.
CHECKPOINTED = ("--model.dtype", "float32", "--training.mixed_precision", "false", "--training.steps", "4",
                "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "true",
                "--checkpoint.interval", "2", "--metrics.log_freq", "100")
EP2 = ("--parallelism.expert_parallel_degree", "2")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
PP_FLAVOR = ("--model.flavor", "k31_debug_pp")
LOCAL_BATCH_4 = ("--training.local_batch_size", "4")

RUNS: dict[str, Run] = {
    # References of each precision policy (tests/test_parallel.py docstring): one process, and FSDP over 2 ranks.
    "one_process": Run(0, (*RECIPE, *SHIPPED_STEPS)),
    "one_process_pp_flavor": Run(0, (*RECIPE, *SHIPPED_STEPS, *PP_FLAVOR)),
    "fsdp2": Run(2, (*RECIPE, *SHIPPED_STEPS, *LOCAL_BATCH_4)),
    "ep2": Run(2, (*RECIPE, *SHIPPED_STEPS, *EP2, *LOCAL_BATCH_4)),
    "pp2": Run(2, (*RECIPE, *SHIPPED_STEPS, *PP2)),
    "pp2_interleaved": Run(2, (*RECIPE, *SHIPPED_STEPS, *PP_FLAVOR, *PP2,
                               "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")),
    "pp2_zbv": Run(2, (*RECIPE, *SHIPPED_STEPS, *PP_FLAVOR, *PP2,
                       "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble")),
    "pp2_ep2_fsdp2": Run(4, (*RECIPE, *SHIPPED_STEPS, *PP2, *EP2, *LOCAL_BATCH_4)),
    # EP4 with rows moved node by node (4 ranks as 2 nodes of 2), each node's sums rounded to bf16.
    "ep4_hierarchical": Run(4, (*RECIPE, *SHIPPED_STEPS, "--parallelism.expert_parallel_degree", "4",
                                "--parallelism.expert_parallel_dispatch", "hierarchical",
                                "--parallelism.expert_parallel_node_size", "2", "--training.local_batch_size", "2")),
    "cp2": Run(2, (*RECIPE, *SHIPPED_STEPS, *CP2)),
    "cp2_ep2": Run(2, (*RECIPE, *SHIPPED_STEPS, *CP2, *EP2)),
    "cp2_pp2": Run(4, (*RECIPE, *SHIPPED_STEPS, *CP2, *PP2)),
    # Saved at PP2 x EP2, resumed at one process and at EP2.
    "saved_pp2_ep2": Run(4, (*RECIPE, *CHECKPOINTED, *PP2, *EP2, *LOCAL_BATCH_4)),
    "pp2_ep2_to_single": Run(0, (*RECIPE, *CHECKPOINTED, "--training.local_batch_size", "8"),
                             resumes=("saved_pp2_ep2", "step-2")),
    "pp2_ep2_to_ep2": Run(2, (*RECIPE, *CHECKPOINTED, *EP2, *LOCAL_BATCH_4), resumes=("saved_pp2_ep2", "step-2")),
    # Saved under CP2 (zigzag), resumed at one process and under the contiguous layout.
    "saved_cp2": Run(2, (*RECIPE, *CHECKPOINTED, *CP2)),
    "cp2_to_single": Run(0, (*RECIPE, *CHECKPOINTED), resumes=("saved_cp2", "step-2")),
    "cp2_to_contiguous": Run(2, (*RECIPE, *CHECKPOINTED, *CP2, "--parallelism.context_parallel_layout", "contiguous"),
                             resumes=("saved_cp2", "step-2")),
    # EP2 x FSDP2 at 64 tokens, the last of 2 steps profiled (tests/test_profiling.py); last in its launch.
    "profiled_ep2": Run(2, (*RECIPE, "--training.steps", "2", "--lr_scheduler.warmup_steps", "0", "--training.seq_len",
                            "64", "--training.local_batch_size", "2", *EP2, "--profiling.enable", "true")),
}
