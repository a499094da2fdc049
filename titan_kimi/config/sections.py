"""The job config: one dataclass per TOML section, every field with a default, a meaning and its valid values.

Names follow torchtitan 0.2.2 where a torchtitan concept exists, so recipes read the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from lowerings.catalog import BACKEND_OPS
from lowerings.settings import FLA_CONFIG_CHOICES, KernelSettings
from titan_kimi.config.options import Bounds, above, at_least, between, option
from titan_kimi.config.schedules import SCHEDULES

DTYPES = ("bfloat16", "float32")


@dataclass
class Job:
    config_file: str = option(
        "", "TOML recipe this config was read from (set with --job.config_file on the command line)")
    dump_folder: str = option("./outputs", "root folder for checkpoints, metrics and logs", nonempty=True)
    description: str = option("", "free text describing the run, printed at start")
    seed: int = option(
        1234, "random seed for model init, data order and dropout", bounds=between(0, 2**32, high_open=True))
    deterministic: bool = option(
        False, "use deterministic algorithms (slower; for debugging and parity tests)")
    dry_run: bool = option(
        False, "validate the config, build the model and parallelism plan, then exit without training")
    estimate_activations: bool = option(
        False, "with job.dry_run: also measure each pipeline rank's peak activation memory at the configured "
        "shapes (one forward + backward on fake tensors, no memory used; tens of seconds per stage)")
    estimate_step_time: bool = option(
        False, "with job.dry_run: also estimate the step time of the layout under each pipeline schedule, and sweep "
        "the layouts of step_time.gpu_counts for the fastest that fits (measured per-layer times from the "
        "[step_time] table plus its communication model; docs/step_time_model.md)")
    world_size: int = option(
        0, "number of ranks; 0 = take it from the launcher (WORLD_SIZE)", bounds=at_least(0))
    print_config: bool = option(False, "print the resolved config as TOML at start")


@dataclass
class Model:
    name: str = option("kimi_k3", "model family", choices=("kimi_k3",))
    flavor: str = option(
        "k31_debug", "model size/variant from the flavor registry (k3_* text, k31_* with the indexer)",
        nonempty=True)
    hf_config_path: str = option("", "checkpoint config.json to build model args from; \"\" = use the flavor")
    tokenizer_path: str = option(
        "", "tokenizer folder (tiktoken.model + tokenizer_config.json); \"\" = the bundled tokenizer")
    dtype: str = option("bfloat16", "dtype the model parameters are kept in", choices=DTYPES)
    add_indexer: bool = option(
        False, "give a K3 model (a k3_* flavor, or a model.hf_config_path without indexer fields) a freshly "
        "initialised K3.1 indexer and sparse MLA in its gated MLA layers (the k31_* sibling's indexer shape; for a "
        "config.json: 64 heads x 128, top-2048), for indexer.mode = warmup to train; an initial checkpoint without "
        "indexer weights then loads everything else and leaves the indexer as initialised")
    dsa_dense_shortcut: bool = option(
        True, "K3.1: for a batch whose longest document (padding excluded) has at most index_topk tokens, skip "
        "the indexer and run dense causal attention in the DSA layers; the top-k would select every causal key, "
        "so losses and gradients are the same (decided on the host per batch: at most two compiled variants); "
        "false = always the indexer and sparse attention")
    vision_flavor: str = option(
        "", "vision tower of an image-text model: moonvit3d (the released 27-block MoonViT3d), moonvit3d_debug; "
        "\"\" = a text model, or the vision_config of model.hf_config_path when it has one")
    freeze_vision_tower: bool = option(
        True, "keep the vision tower's weights frozen (the projector and the text model train)")


@dataclass
class Training:
    steps: int = option(10, "number of optimizer steps to train", bounds=at_least(1))
    global_batch_size: int = option(
        -1, "sequences per optimizer step; -1 = local_batch_size * data-parallel degree (no accumulation)",
        bounds=at_least(1, also=(-1,)))
    local_batch_size: int = option(8, "sequences per rank per micro-step", bounds=at_least(1))
    seq_len: int = option(2048, "tokens per sequence", bounds=at_least(1))
    pad_to_multiple_of: int = option(
        0, "0 = every batch runs at seq_len, padding included (as the padded datasets fill their rows); N > 0 = each "
        "micro-batch runs only up to its rows' last real token, rounded up to a multiple of N (at most seq_len), so "
        "the padding after it costs nothing (the batch's length then changes from step to step; compiled regions "
        "see it as a dynamic size; a pipeline builds its stages' buffers for each new length). Under context "
        "parallelism a multiple of the row's chunks (2 x context_parallel_degree zigzag, x 1 contiguous)",
        bounds=at_least(0))
    max_norm: float = option(1.0, "gradient-norm clipping threshold", bounds=above(0))
    nonfinite_grad_policy: str = option(
        "skip", "on a NaN/inf gradient norm: skip the optimizer step, or stop the run",
        choices=("skip", "stop"))
    loss_chunk_size: int = option(
        512, "tokens per chunk of the reference linear cross-entropy (kernels.linear_cross_entropy = reference, the CPU "
        "path; bounds its logits memory); the fused GPU backends choose their own tiling", bounds=at_least(1))
    param_dtype: str = option(
        "bfloat16", "compute dtype of parameters under FSDP mixed precision", choices=DTYPES)
    reduce_dtype: str = option(
        "float32", "dtype of gradient reduction under FSDP mixed precision", choices=("float32", "bfloat16"))
    mixed_precision: bool = option(True, "apply the FSDP mixed-precision policy (param_dtype, reduce_dtype)")
    routed_expert_gemm: str = option(
        "default", "the routed experts' grouped GEMMs: default = in the compute dtype; fp8_rowwise = FP8 with dynamic "
        "row-wise scales in the forward and both backward GEMMs (torchao's; needs an sm89+ GPU; an opt-in, measured "
        "against bf16 in docs/perf.md)", choices=("default", "fp8_rowwise"))
    gc_freq: int = option(
        50, "run Python garbage collection every N steps (automatic collection is off during training)",
        bounds=at_least(1))


@dataclass
class Optimizer:
    name: str = option("AdamW", "optimizer", choices=("AdamW", "Adam"))
    lr: float = option(8e-4, "peak learning rate", bounds=at_least(0))
    betas: list[float] = option(
        [0.9, 0.95], "Adam beta1, beta2", length=2, bounds=between(0, 1, high_open=True))
    eps: float = option(1e-8, "Adam epsilon", bounds=above(0))
    weight_decay: float = option(0.1, "weight decay (decoupled for AdamW, L2 for Adam)", bounds=at_least(0))
    implementation: str = option(
        "auto", "torch's Adam implementation (needs optimizer.state_dtype = model.dtype); auto = fused where the "
        "device supports it, or titan_kimi's multi-tensor Adam when the moment dtype differs from the parameters'",
        choices=("auto", "fused", "foreach", "for-loop"))
    state_dtype: str = option("float32", "dtype of the Adam moments", choices=DTYPES)


@dataclass
class LRScheduler:
    warmup_steps: int = option(2, "linear warmup steps from 0 to optimizer.lr", bounds=at_least(0))
    decay_ratio: float = option(
        -1.0, "fraction of training.steps spent decaying at the end; -1 = decay over all post-warmup steps",
        bounds=between(0, 1, also=(-1,)))
    decay_type: str = option(
        "linear", "shape of the decay; constant = no decay after warmup",
        choices=("linear", "cosine", "sqrt", "constant"))
    min_lr_factor: float = option(
        0.0, "final learning rate as a fraction of optimizer.lr", bounds=between(0, 1))


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = option(1, "DDP/HSDP replicate degree", bounds=at_least(1))
    data_parallel_shard_degree: int = option(
        -1, "FSDP2 shard degree; -1 = the ranks left after the other degrees", bounds=at_least(1, also=(-1,)))
    tensor_parallel_degree: int = option(
        1, "tensor parallelism; only 1 (not supported)", bounds=between(1, 1),
        hint="Tensor parallelism is not supported: the model owns context parallelism "
             "(parallelism.context_parallel_degree) and shards experts with parallelism.expert_parallel_degree")
    context_parallel_degree: int = option(
        1, "context parallelism: ranks that split every sequence (KDA, MLA and the indexer); they read the same "
        "batch and share the FSDP mesh", bounds=at_least(1))
    context_parallel_layout: str = option(
        "zigzag", "how a sequence is split over the context-parallel ranks: zigzag = 2 x degree chunks, rank r "
        "holding chunks r and 2 x degree - 1 - r (balances causal attention, whose cost grows along the "
        "sequence); contiguous = one chunk per rank in order. seq_len must divide into the chunks",
        choices=("zigzag", "contiguous"))
    pipeline_parallel_degree: int = option(
        1, "pipeline stages (split at AttnRes block boundaries)", bounds=at_least(1))
    pipeline_parallel_schedule: str = option(
        "1F1B", "pipeline schedule (torch.distributed.pipelining); Interleaved*/LoopedBFS run 2+ stages per rank, "
        "ZBVZeroBubble/DualPipeV exactly 2 in a V",
        choices=SCHEDULES)
    pipeline_parallel_stages_per_rank: int = option(
        0, "pipeline stages on each rank (virtual stages); 0 = the schedule's own (1 for 1F1B/GPipe, else 2)",
        bounds=at_least(0))
    pipeline_parallel_split: list[int] = option(
        [], "first layer of every pipeline stage after the first (multiples of the AttnRes block size); "
        "[] = whole blocks split evenly, earlier stages taking the extra ones")
    pipeline_parallel_microbatch_size: int = option(
        1, "sequences per pipeline microbatch", bounds=at_least(1))
    expert_parallel_degree: int = option(
        1, "expert parallelism for the MoE experts (borrows from data_parallel_shard * context_parallel)",
        bounds=at_least(1))
    expert_parallel_dispatch: str = option(
        "flat", "how expert parallelism moves the routed rows: flat = one all-to-all over the EP group each way "
        "(torchtitan's: a token goes once to every EP rank holding one of its experts); hierarchical = across "
        "nodes once per node (to the rank of the same local index there), then over the node to the experts' "
        "ranks, the combine summing each node's weighted outputs before they cross back (fewer bytes on the "
        "network when a token's experts share nodes; the node sums round to the compute dtype). Needs an EP "
        "group of 2+ whole nodes (expert_parallel_node_size)", choices=("flat", "hierarchical"))
    expert_parallel_node_size: int = option(
        0, "ranks per node for the hierarchical dispatch; 0 = the launcher's LOCAL_WORLD_SIZE (torchrun's "
        "ranks per node)", bounds=at_least(0))
    pipeline_prefetch_weights: bool = option(
        False, "pipeline parallelism with FSDP: from the second step on, start gathering every FSDP unit of this "
        "rank's stages when the step begins (asynchronously, in forward order) rather than in the first "
        "microbatch's forward, so that a stage gathers while it waits for its first input (the step-time estimate "
        "counts the gathers hidden behind that wait); needs the gathered weights kept for the step "
        "(fsdp_reshard_after_forward default or never)")
    pipeline_gradient_sync: str = option(
        "step", "pipeline parallelism with FSDP: when each FSDP unit reduce-scatters its gradients. step = once, "
        "after the rank's last backward (torch's default: the unsharded gradients of every gathered unit "
        "accumulate in training.reduce_dtype over the step's microbatches); microbatch = in every microbatch's "
        "backward, overlapped with the next unit's backward (those unsharded gradients never accumulate; costs "
        "microbatches x the reduce-scatters, and the sharded gradient sums the microbatches in the weights' dtype). "
        "Needs pipeline parallelism; not with the split-backward schedules (InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV)",
        choices=("step", "microbatch"))
    fsdp_reshard_after_forward: str = option(
        "default", "free gathered parameters after forward: default = yes without pipeline parallelism, no with "
        "it (each microbatch would gather the stage's weights again); the output head always keeps them",
        choices=("default", "always", "never"))


@dataclass
class Checkpoint:
    enable: bool = option(False, "save DCP checkpoints and resume from the latest one")
    folder: str = option("checkpoint", "checkpoint folder, under job.dump_folder", nonempty=True)
    interval: int = option(500, "save every N steps", bounds=at_least(1))
    keep_latest_k: int = option(
        10, "keep the newest K checkpoints; 0 = keep all (1 is unsafe while a save is in flight)",
        bounds=at_least(2, also=(0,)))
    async_mode: str = option(
        "disabled", "asynchronous saving", choices=("disabled", "async", "async_with_pinned_mem"))
    initial_load_path: str = option(
        "", "weights to start from: an HF safetensors folder or a DCP step folder; \"\" = random init")
    initial_load_model_only: bool = option(
        True, "load only the model weights from initial_load_path; only true is built (resume a run to continue "
        "its optimizer state)")
    load_step: int = option(-1, "step to resume from; -1 = the latest", bounds=at_least(0, also=(-1,)))
    last_save_model_only: bool = option(
        True, "the final save holds only the model weights (no optimizer state)")
    last_save_in_hf: bool = option(
        False, "write the final save as HF safetensors (needs last_save_model_only)")
    export_dtype: str = option("bfloat16", "dtype of the final HF safetensors export (last_save_in_hf)", choices=DTYPES)


@dataclass
class ActivationCheckpoint:
    mode: str = option(
        "none", "activation checkpointing of decoder blocks", choices=("none", "full", "selective"))
    selective_ac_option: str = option(
        "op", "selective mode: \"op\" (save the token mixers', grouped GEMMs', every other matmul's and the expert "
        "exchanges' outputs), \"mixers\" (recompute all but the token mixers' outputs: KDA, sparse MLA, the "
        "indexer's top-k, attention) or N as digits (checkpoint every Nth block)")
    uncheckpointed_blocks: int = option(
        0, "under full, op or mixers checkpointing: the last N decoder blocks of each pipeline stage run without it "
        "(they keep all their activations, and their backward skips the recomputed forward; theirs runs first, so "
        "their activations are freed before any checkpointed block recomputes); the dry run's step-time estimate "
        "names the most that fit", bounds=at_least(0))


@dataclass
class Compile:
    mode: str = option(
        "none", "torch.compile mode; none = eager",
        choices=("none", "default", "inductor", "max-autotune", "reduce-overhead"))
    fullgraph: bool = option(True, "compile each region as one graph (graph breaks are errors)")
    granularity: str = option(
        "block", "what one compiled region is: block = a whole decoder block (most fusion; one graph per block "
        "variant), module = a block's norms, attention and FFN apart (one graph per module kind: a shorter "
        "first step)", choices=("block", "module"))
    prewarm_modules: bool = option(
        False, "with granularity = module in a single-process text run: compile each attention and FFN kind in "
        "its own background process at launch, the first step waiting for them and then loading their graphs "
        "from Inductor's cache instead of compiling them one after another (on one 16-core H200 the first step "
        "comes later than without it: each process imports and builds its layer before compiling; docs/perf.md)")
    components: list[str] = option(
        ["model"], "what to compile: model = every decoder block, loss = the head's fused linear cross-entropy",
        choices=("model", "loss"))
    cache_dir: str = option(
        "", "a persistent folder for Inductor's and Triton's compile caches (its inductor/ and triton/ replace "
        "TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR): a restart or another machine pointed at it loads the "
        "compiled graphs and kernels instead of compiling them in the first step; \"\" = torch's and Triton's "
        "defaults (under /tmp and ~/.triton)")


# Keys of [kernels] that the trainer applies itself (titan_kimi/training), not lowerings/settings.py.
TRAINER_KERNEL_KEYS = ("prewarm_fla",)

# One key per op of lowerings/catalog.py (the one op list), then the kernel settings of lowerings/settings.py,
# then TRAINER_KERNEL_KEYS.
Kernels = make_dataclass("Kernels", [
    *[(op, str, option("auto", entry.help, choices=("auto", *entry.backends))) for op, entry in BACKEND_OPS.items()],
    ("triton_autotune", bool, option(
        KernelSettings.triton_autotune,
        "autotune the Triton kernels of lowerings/kernels on the GPU; false = their default configs (a faster "
        "first step, for debugging and benchmarks)")),
    ("sparse_mla_ws", bool, option(
        KernelSettings.sparse_mla_ws,
        "on Hopper, run the warp-specialized Gluon sparse-MLA forward; false = the Triton-language kernel")),
    ("fla_configs", str, option(
        KernelSettings.fla_configs,
        "FLA's Triton autotune configs: shipped = the ones tuned for this GPU in lowerings/kernels/fla_configs "
        "(FLA tunes what they lack), autotune = FLA tunes everything at the first step",
        choices=FLA_CONFIG_CHOICES)),
    ("prewarm_fla", bool, option(
        True,
        "with kda = fla on a GPU: compile FLA's KDA kernels at this run's shape in background processes (four, "
        "sharing the kernels out; started before the trainer's imports under python -m titan_kimi.train), so the "
        "first step loads them from Triton's cache (not needed, so not started, with compile.prewarm_modules); "
        "false = they compile inside the first step")),
])


@dataclass
class Data:
    dataset: str = option(
        "packed_text",
        "training dataset: packed_text packs documents into seq_len rows (document ids reset the model state); "
        "hellaswag and medpix are one padded example per row",
        choices=("packed_text", "hellaswag", "synthetic", "medpix"))
    path: str = option(
        "", "dataset file (.jsonl, .json or .parquet; medpix also a folder of parquet files or a datasets "
        "save_to_disk folder); \"\" = the bundled sample (synthetic takes none)")
    shuffle: bool = option(True, "shuffle examples (seeded by job.seed)")
    validation_path: str = option(
        "", "validation data file; \"\" = the bundled sample's validation split (with data.path = \"\")")
    image_min_pixels: int = option(
        3136, "medpix: images smaller than this many pixels are scaled up (keeping the aspect ratio)",
        bounds=at_least(1))
    image_max_pixels: int = option(
        802816, "medpix: images larger than this many pixels are scaled down (default 896 x 896: 1,024 image "
        "tokens)", bounds=at_least(784))


@dataclass
class Metrics:
    log_freq: int = option(1, "log metrics every N steps", bounds=at_least(1))
    enable_tensorboard: bool = option(False, "write TensorBoard events under job.dump_folder/tb")
    save_jsonl: bool = option(True, "append per-step metrics to job.dump_folder/metrics.jsonl")
    peak_flops: float = option(
        989e12, "peak FLOP/s per device for MFU (default: H200 dense bf16)", bounds=above(0))
    progress: str = option("auto", "progress bar; auto = only on a terminal", choices=("auto", "on", "off"))


@dataclass
class Profiling:
    enable: bool = option(
        False, "profile training steps with torch.profiler: per rank a chrome trace, a kernel table and a summary "
        "(step time, CUDA busy time, the share of the step in communication: NCCL kernels on CUDA, c10d/gloo "
        "host ops on CPU), logged by rank 0 and appended to metrics.jsonl")
    steps: list[int] = option(
        [-1], "steps to profile, as numbered in the log (1 .. training.steps); -1 = the last step. A profiled "
        "step runs slower (the profiler's overhead): leave it out of speed medians", bounds=at_least(1, also=(-1,)),
        nonempty=True)
    folder: str = option(
        "profiles", "profile folder, under job.dump_folder: step-<N>/rank<R>.trace.json.gz, rank<R>.kernels.txt, "
        "rank<R>.summary.json", nonempty=True)


@dataclass
class Validation:
    enable: bool = option(False, "run validation during training")
    freq: int = option(10, "validate every N steps", bounds=at_least(1))
    steps: int = option(
        -1, "validation batches per run; -1 = the whole validation set", bounds=at_least(1, also=(-1,)))


@dataclass
class Indexer:
    mode: str = option(
        "frozen", "how the K3.1 indexer trains: frozen = not at all (hard top-k gives it no LM-loss gradient); "
        "warmup = the DSA layers attend densely and the indexer learns the main attention's head-summed, "
        "L1-normalised probabilities over every causal key (KL; indexer.warmup_trains says what else trains); "
        "sparse = the DSA layers attend to the indexer's top-k, the whole model trains with the LM loss and the "
        "indexer keeps its KL over the selected keys. The indexer's input is detached: it learns only from the "
        "KL, the rest of the model only from the LM loss. LoRA never adapts the indexer; in warmup/sparse its own "
        "weights train", choices=("frozen", "warmup", "sparse"))
    kl_weight: float = option(
        1.0, "weight of the indexer's KL term (the mean over the step's real queries and the DSA layers) in the "
        "loss; only the indexer's gradient depends on it", bounds=above(0))
    warmup_trains: str = option(
        "indexer", "with mode = warmup, what trains: indexer = the indexer only (DeepSeek-V3.2's dense warm-up; "
        "every other weight frozen), all = the indexer and the rest of the model (with its LM loss through the "
        "dense attention, or its LoRA adapters)", choices=("indexer", "all"))


@dataclass
class Lora:
    enable: bool = option(
        False, "train LoRA adapters instead of all weights: every base weight is frozen, and the indexer too "
        "unless indexer.mode trains it (never through adapters)")
    rank: int = option(8, "adapter rank (a multiple of 8 when the routed experts are adapted)", bounds=at_least(1))
    alpha: float = option(16.0, "adapter scale numerator (scale = alpha / rank)", bounds=above(0))
    dropout: float = option(
        0.0, "dropout on the adapter input (where layers call their module; merged weights read directly take "
        "none)", bounds=between(0, 1, high_open=True))
    target_modules: list[str] = option(
        ["attention", "mlp", "shared_experts", "experts"],
        "modules to adapt: groups attention|mlp|shared_experts|experts|latent_proj|router|lm_head|vision_tower|"
        "projector, globs over module names (layers.*.attention.o_proj) or bare names (o_proj); never the indexer "
        "(indexer.mode trains its own weights)")
    adapter_path: str = option(
        "", "adapters to start from: a folder with adapter_model.safetensors (PEFT layout); \"\" = fresh adapters")
    save_adapters: bool = option(
        True, "write the trained adapters (adapter_model.safetensors + adapter_config.json) to "
        "job.dump_folder/lora_adapters at the end")


@dataclass
class StepTime:
    nvlink_gb_per_s: float = option(
        360.0, "job.estimate_step_time: achieved NVLink bandwidth per GPU and direction inside a node, GB/s (H200 "
        "NVLink 4: 450 nominal)", bounds=above(0))
    internode_gb_per_s: float = option(
        45.0, "job.estimate_step_time: achieved bandwidth between nodes per GPU and direction, GB/s (one 400 Gb/s "
        "NIC per GPU: 50 nominal)", bounds=above(0))
    gpus_per_node: int = option(
        8, "job.estimate_step_time: GPUs per node (ranks of one node talk over NVLink)", bounds=at_least(1))
    latency_us: float = option(
        25.0, "job.estimate_step_time: fixed cost of each collective or pipeline transfer, microseconds",
        bounds=at_least(0))
    gpu_counts: list[int] = option(
        [], "job.estimate_step_time: GPU counts whose layouts are swept for the fastest that fits in "
        "step_time.memory_gib (at the recipe's global batch and sequence length); [] = the job's world size",
        bounds=at_least(1))
    sweep_batch: str = option(
        "per_gpu", "job.estimate_step_time: the global batch of a swept GPU count: per_gpu = the recipe's sequences "
        "per GPU (the global batch grows with the GPUs), recipe = the recipe's global batch at every count",
        choices=("per_gpu", "recipe"))
    memory_gib: float = option(
        140.0, "job.estimate_step_time: memory per GPU a swept layout must fit in, GiB (H200: 140)",
        bounds=above(0))
    expert_load: str = option(
        "balanced", "job.estimate_step_time: the routed rows of the busiest EP rank: balanced, or skewed (the "
        "load of the table's skewed MoE measurement)", choices=("balanced", "skewed"))
    table: str = option(
        "", "job.estimate_step_time: the measured per-layer table (scripts/bench/rank_slice.py writes it); \"\" = "
        "the shipped titan_kimi/parallel/step_time_h200.json")
    rows: str = option(
        "", "job.estimate_step_time: what a row of training.seq_len holds (its segments decide attention work): "
        "padded:<valid tokens>, packed:<documents> or medpix:<text tokens>:<H>x<W> (one image); \"\" = the "
        "dataset's (medpix: one 896x896 image + 128 text tokens; hellaswag: padded:128; packed_text: packed:4)")
    fallback_mfu: float = option(
        0.4, "job.estimate_step_time: for layer kinds the table lacks (or without a table), the FLOP rate as a "
        "fraction of metrics.peak_flops; a stated guess, and every such line says so",
        bounds=Bounds(low=0, high=1, low_open=True))
    top: int = option(5, "job.estimate_step_time: layouts printed per swept GPU count", bounds=at_least(1))


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    kernels: Kernels = field(default_factory=Kernels)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    lora: Lora = field(default_factory=Lora)
    step_time: StepTime = field(default_factory=StepTime)
    indexer: Indexer = field(default_factory=Indexer)
