"""The pipeline schedules of torch.distributed.pipelining that a config may name, by how they place stages on
ranks and run the backward: the one list the config's choices, its rules and the pipeline plan read."""

SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
LOOPED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2 * pp - 1 - r
# input and weight gradients as separate actions (FSDP's post-backward hooks fire after the input half)
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
