"""Checks that involve several keys, or the file system. Each error names every key involved and its source."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from titan_kimi.config.errors import ConfigError, bad_value, mention
from titan_kimi.config.sections import JobConfig
from titan_kimi.config.schedules import SPLIT_BACKWARD_SCHEDULES

SourceOf = Callable[[str], str]
Rule = Callable[[JobConfig, SourceOf], None]

_WIDTH = {"bfloat16": 16, "float32": 32}
_CHECKPOINT_MARKERS = (".metadata", "model.safetensors.index.json", "model.safetensors")
_PATH_KINDS = {"file": ("an existing file", Path.is_file), "dir": ("an existing folder", Path.is_dir),
               "any": ("an existing file or folder", Path.exists)}


def _get(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _reject(cfg: JobConfig, key: str, source_of: SourceOf, problem: str, valid: str,
            hint: str | None = None) -> ConfigError:
    return bad_value(key, _get(cfg, key), source_of(key), problem, valid, hint)


def _other(cfg: JobConfig, key: str, source_of: SourceOf) -> str:
    return mention(key, _get(cfg, key), source_of(key))


def lora_settings_need_lora(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.lora.enable and not cfg.lora.target_modules:
        raise _reject(cfg, "lora.target_modules", source_of, "adapts nothing", "group names such as "
                      "attention|mlp|shared_experts|experts, module-name globs or bare module names")
    if cfg.lora.adapter_path and not cfg.lora.enable:
        raise _reject(cfg, "lora.adapter_path", source_of,
                      f"adapters are only loaded with {_other(cfg, 'lora.enable', source_of)}",
                      "\"\", or lora.enable = true")


def indexer_settings_fit_the_mode(cfg: JobConfig, source_of: SourceOf) -> None:
    mode = _other(cfg, "indexer.mode", source_of)
    if cfg.indexer.warmup_trains != "indexer" and cfg.indexer.mode != "warmup":
        raise _reject(cfg, "indexer.warmup_trains", source_of, f"applies to the warm-up only, and {mode}",
                      "\"indexer\" (the default), or indexer.mode = \"warmup\"")
    if cfg.lora.enable and cfg.indexer.mode == "warmup" and cfg.indexer.warmup_trains == "indexer":
        raise _reject(cfg, "lora.enable", source_of,
                      f"adapters would never train: with {mode} and "
                      f"{_other(cfg, 'indexer.warmup_trains', source_of)} only the indexer's own weights do",
                      "false, or indexer.warmup_trains = \"all\" (adapters and indexer), or indexer.mode = "
                      "\"sparse\"")


def medpix_needs_a_vision_tower(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.data.dataset == "medpix" and not cfg.model.vision_flavor and not cfg.model.hf_config_path:
        raise _reject(cfg, "model.vision_flavor", source_of,
                      f"{_other(cfg, 'data.dataset', source_of)} is image-text data, and a text model has no "
                      "vision tower", "moonvit3d|moonvit3d_debug, or a model.hf_config_path with a vision_config")


def image_pixel_bounds_are_ordered(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.data.image_min_pixels > cfg.data.image_max_pixels:
        raise _reject(cfg, "data.image_min_pixels", source_of,
                      f"is above {_other(cfg, 'data.image_max_pixels', source_of)}",
                      f"at most {cfg.data.image_max_pixels}")


def activation_estimate_is_a_dry_run(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.job.estimate_activations and not cfg.job.dry_run:
        raise _reject(cfg, "job.estimate_activations", source_of, "is measured by a dry run only",
                      "false, or job.dry_run = true as well")


def step_time_estimate_is_a_dry_run(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.job.estimate_step_time and not cfg.job.dry_run:
        raise _reject(cfg, "job.estimate_step_time", source_of, "is computed by a dry run only",
                      "false, or job.dry_run = true as well")
    if cfg.step_time.table and not Path(cfg.step_time.table).is_file():
        raise _reject(cfg, "step_time.table", source_of, "is not an existing file",
                      "\"\" (the shipped table) or a table written by scripts/bench/rank_slice.py")


def microbatch_gradient_sync_needs_a_pipeline_of_whole_backwards(cfg: JobConfig, source_of: SourceOf) -> None:
    p = cfg.parallelism
    if p.pipeline_gradient_sync == "microbatch" and p.pipeline_parallel_degree == 1:
        raise _reject(cfg, "parallelism.pipeline_gradient_sync", source_of,
                      f"decides when a pipeline stage's FSDP units reduce-scatter, but "
                      f"{_other(cfg, 'parallelism.pipeline_parallel_degree', source_of)}",
                      "step without pipeline parallelism (FSDP then reduce-scatters in every backward)")
    # FSDP reduce-scatters from its post-backward hooks, which a split backward fires before the weight gradients
    # exist (the input half) or never (the weight half).
    if p.pipeline_gradient_sync == "microbatch" and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise _reject(cfg, "parallelism.pipeline_gradient_sync", source_of,
                      f"reduce-scatters in FSDP's post-backward hooks, which "
                      f"{_other(cfg, 'parallelism.pipeline_parallel_schedule', source_of)} runs before its weight "
                      "gradients exist (it splits the backward)",
                      "step, or a schedule with a whole backward: 1F1B, GPipe, Interleaved1F1B, LoopedBFS")


def weight_prefetch_needs_kept_weights(cfg: JobConfig, source_of: SourceOf) -> None:
    p = cfg.parallelism
    if not p.pipeline_prefetch_weights:
        return
    if p.pipeline_parallel_degree == 1:
        raise _reject(cfg, "parallelism.pipeline_prefetch_weights", source_of,
                      f"prefetches a pipeline stage's weights, but {_other(cfg, 'parallelism.pipeline_parallel_degree', source_of)}",
                      "false without pipeline parallelism")
    if p.fsdp_reshard_after_forward == "always":
        raise _reject(cfg, "parallelism.pipeline_prefetch_weights", source_of,
                      f"gathers weights that {_other(cfg, 'parallelism.fsdp_reshard_after_forward', source_of)} frees "
                      "after every forward", "false, or fsdp_reshard_after_forward = default | never")


def schedule_fits_in_training(cfg: JobConfig, source_of: SourceOf) -> None:
    steps, sched = cfg.training.steps, cfg.lr_scheduler
    if sched.warmup_steps > steps:
        raise _reject(cfg, "lr_scheduler.warmup_steps", source_of,
                      f"warmup is longer than the run ({_other(cfg, 'training.steps', source_of)})",
                      f"0..{steps}")
    if sched.decay_ratio == -1:
        return
    if sched.decay_type == "constant":
        raise _reject(cfg, "lr_scheduler.decay_ratio", source_of,
                      f"has no effect with {_other(cfg, 'lr_scheduler.decay_type', source_of)}",
                      "-1, or a decay_type of linear|cosine|sqrt")
    decay_steps = round(steps * sched.decay_ratio)
    if sched.warmup_steps + decay_steps > steps:
        most = (steps - sched.warmup_steps) / steps
        raise _reject(cfg, "lr_scheduler.decay_ratio", source_of,
                      f"{decay_steps} decay steps plus {_other(cfg, 'lr_scheduler.warmup_steps', source_of)} "
                      f"exceed {_other(cfg, 'training.steps', source_of)}", f"-1 or in [0, {most:.4g}]")


NAMED_SELECTIVE_OPTIONS = ("op", "mixers")  # the selective_ac_option values other than a block frequency


def checkpoints_every_block(mode: str, option: str) -> bool:
    """Whether activation checkpointing ``mode`` / ``option`` wraps every block (full, op, mixers): the modes
    ``uncheckpointed_blocks`` can take blocks out of (none wraps none, a block frequency every N-th)."""
    return mode == "full" or (mode == "selective" and option in NAMED_SELECTIVE_OPTIONS)


def selective_ac_option_is_known(cfg: JobConfig, source_of: SourceOf) -> None:
    option = cfg.activation_checkpoint.selective_ac_option
    if option not in NAMED_SELECTIVE_OPTIONS and not (re.fullmatch(r"\d+", option) and int(option) >= 1):
        raise _reject(cfg, "activation_checkpoint.selective_ac_option", source_of, "not a selective-AC option",
                      "\"op\", \"mixers\", or a block frequency written as digits >= 1 (e.g. \"2\")")


def uncheckpointed_blocks_need_checkpointing(cfg: JobConfig, source_of: SourceOf) -> None:
    ac = cfg.activation_checkpoint
    if ac.uncheckpointed_blocks and not checkpoints_every_block(ac.mode, ac.selective_ac_option):
        mode = _other(cfg, "activation_checkpoint.mode", source_of)
        if ac.mode == "selective":
            mode += " with " + _other(cfg, "activation_checkpoint.selective_ac_option", source_of)
        raise _reject(cfg, "activation_checkpoint.uncheckpointed_blocks", source_of,
                      f"has no blocks to take out of checkpointing under {mode}",
                      "0, or mode = \"full\" or \"selective\" with selective_ac_option \"op\" or \"mixers\"")


def compile_has_components(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.compile.mode != "none" and not cfg.compile.components:
        raise _reject(cfg, "compile.components", source_of,
                      f"nothing to compile with {_other(cfg, 'compile.mode', source_of)}",
                      "one or both of model|loss, or compile.mode = \"none\"")


def module_compile_without_checkpointing(cfg: JobConfig, source_of: SourceOf) -> None:
    # Checkpointing recomputes a block in its backward; with its modules compiled apart that re-runs compiled
    # regions (CUDA graphs under reduce-overhead) inside the backward, a combination no test runs yet.
    if (cfg.compile.mode != "none" and cfg.compile.granularity == "module"
            and cfg.activation_checkpoint.mode != "none"):
        raise _reject(cfg, "compile.granularity", source_of,
                      f"not supported with {_other(cfg, 'activation_checkpoint.mode', source_of)}",
                      "\"block\" (each checkpointed block compiled whole), or activation_checkpoint.mode = \"none\"")


def cuda_graphs_where_they_hold(cfg: JobConfig, source_of: SourceOf) -> None:
    # reduce-overhead's CUDA-graph trees fail or reuse live memory in two settings:
    # - checkpointing: a block's recompute replays its compiled regions inside torch's (non-reentrant)
    #   checkpoint, recorded with other tensor lifetimes than they replay with ("graph recording observed an
    #   input tensor deallocate during graph recording that did not occur during replay"; pytorch/pytorch#154306,
    #   still so on torch 2.11);
    # - pipelines: each forward starts a new generation, whose replays reuse the previous one's output memory,
    #   while the schedule holds earlier microbatches' activations (graph outputs) for their backward.
    if cfg.compile.mode != "reduce-overhead":
        return
    for key, refused, why, instead in (
            ("activation_checkpoint.mode", cfg.activation_checkpoint.mode != "none",
             "the recompute replays CUDA graphs inside torch's checkpoint, which CUDA-graph trees refuse "
             "(pytorch/pytorch#154306)", '"none"'),
            ("parallelism.pipeline_parallel_degree", cfg.parallelism.pipeline_parallel_degree > 1,
             "each microbatch's forward starts a new CUDA-graph generation, which reuses the memory of the earlier "
             "microbatches' outputs the schedule still holds for their backward", "1")):
        if refused:
            raise _reject(cfg, "compile.mode", source_of, f"not supported with {_other(cfg, key, source_of)}: {why}",
                          f'"default", "inductor" or "max-autotune", or {key} = {instead}')


def global_batch_is_whole_local_batches(cfg: JobConfig, source_of: SourceOf) -> None:
    """The per-rank shapes (microbatches, CP chunks, experts) are the layout's checks:
    ``titan_kimi.config.parallelism.check_degrees`` and ``titan_kimi.parallel.layout.check_layout``."""
    t = cfg.training
    if t.global_batch_size != -1 and t.global_batch_size % t.local_batch_size:
        raise _reject(cfg, "training.global_batch_size", source_of,
                      f"not a multiple of {_other(cfg, 'training.local_batch_size', source_of)}",
                      f"-1 or a multiple of {t.local_batch_size} (times the data-parallel degree)")


def context_parallel_kda_has_a_backend(cfg: JobConfig, source_of: SourceOf) -> None:
    """KDA under context parallelism runs FLA's cp_context (fla) or the reference state passing; the cudnn
    backend has no context-parallel path, and falling back to the fp32 reference in silence would hide it."""
    if cfg.parallelism.context_parallel_degree > 1 and cfg.kernels.kda == "cudnn":
        raise _reject(cfg, "kernels.kda", source_of,
                      "has no context-parallel path (with "
                      + _other(cfg, "parallelism.context_parallel_degree", source_of) + ")",
                      "fla (FLA's cp_context), auto, or reference")


def mixed_precision_only_lowers(cfg: JobConfig, source_of: SourceOf) -> None:
    t = cfg.training
    if t.mixed_precision and _WIDTH[t.param_dtype] > _WIDTH[cfg.model.dtype]:
        raise _reject(cfg, "training.param_dtype", source_of,
                      f"is wider than {_other(cfg, 'model.dtype', source_of)}; "
                      "mixed precision can only lower the compute dtype",
                      f"{cfg.model.dtype}, or model.dtype = \"float32\"")


def fp8_expert_gemms_without_adapters(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.training.routed_expert_gemm == "fp8_rowwise" and cfg.lora.enable:
        raise _reject(cfg, "training.routed_expert_gemm", source_of,
                      f"is not combined with {_other(cfg, 'lora.enable', source_of)} (the adapted experts' low-rank "
                      "GEMMs are narrower than FP8's 16-column tiles, and their frozen base needs no FP8 weight "
                      "gradient)", "\"default\", or lora.enable = false")


def checkpoint_keys_need_checkpointing(cfg: JobConfig, source_of: SourceOf) -> None:
    """Keys that act only when checkpointing is on would otherwise be accepted and do nothing."""
    c = cfg.checkpoint
    if c.enable:
        return
    enable = _other(cfg, "checkpoint.enable", source_of)
    if c.load_step != -1:
        raise _reject(cfg, "checkpoint.load_step", source_of, f"nothing is resumed with {enable}",
                      "-1, or checkpoint.enable = true")
    if c.last_save_in_hf:
        raise _reject(cfg, "checkpoint.last_save_in_hf", source_of, f"nothing is saved with {enable}",
                      "false, or checkpoint.enable = true")


def profiling_steps_are_in_the_run(cfg: JobConfig, source_of: SourceOf) -> None:
    p = cfg.profiling
    if not p.enable:
        enable = _other(cfg, "profiling.enable", source_of)
        defaults = {"profiling.steps": [-1], "profiling.folder": "profiles"}
        for key, default in defaults.items():
            if _get(cfg, key) != default:
                raise _reject(cfg, key, source_of, f"nothing is profiled with {enable}",
                              f"{default!r}, or profiling.enable = true")
        return
    late = [s for s in p.steps if s > cfg.training.steps]
    if late:
        raise _reject(cfg, "profiling.steps", source_of,
                      f"step {late[0]} is after the last one ({_other(cfg, 'training.steps', source_of)})",
                      f"steps in 1..{cfg.training.steps}, or -1 (the last)")


def hf_save_is_model_only(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.checkpoint.last_save_in_hf and not cfg.checkpoint.last_save_model_only:
        raise _reject(cfg, "checkpoint.last_save_model_only", source_of,
                      "safetensors hold only model weights, but "
                      + _other(cfg, "checkpoint.last_save_in_hf", source_of),
                      "true (or last_save_in_hf = false)")


def synthetic_data_takes_no_files(cfg: JobConfig, source_of: SourceOf) -> None:
    if cfg.data.dataset != "synthetic":
        return
    dataset = _other(cfg, "data.dataset", source_of)
    for key in ("data.path", "data.validation_path"):
        if _get(cfg, key):
            raise _reject(cfg, key, source_of, f"is never read with {dataset}", "\"\"")
    if cfg.validation.enable and cfg.validation.steps == -1:
        raise _reject(cfg, "validation.steps", source_of,
                      f"\"the whole validation set\" never ends with {dataset}", "an integer >= 1")


def validation_has_data(cfg: JobConfig, source_of: SourceOf) -> None:
    d = cfg.data
    if cfg.validation.enable and d.dataset != "synthetic" and d.path and not d.validation_path:
        raise _reject(cfg, "data.validation_path", source_of,
                      f"\"\" is the bundled sample's validation split, but the training data is "
                      f"{_other(cfg, 'data.path', source_of)}",
                      f"a validation file for that data (or validation.enable = false)")


def optimizer_implementation_fits(cfg: JobConfig, source_of: SourceOf) -> None:
    o = cfg.optimizer
    if o.implementation != "auto" and o.state_dtype != cfg.model.dtype:
        raise _reject(cfg, "optimizer.implementation", source_of,
                      f"torch's {o.implementation} Adam keeps the moments in the parameter dtype "
                      f"({_other(cfg, 'model.dtype', source_of)}), so it cannot keep "
                      f"{_other(cfg, 'optimizer.state_dtype', source_of)}",
                      "\"auto\" (then titan_kimi's Adam keeps the moments in state_dtype), or optimizer.state_dtype "
                      "equal to model.dtype")


def input_paths_exist(cfg: JobConfig, source_of: SourceOf) -> None:
    data_kind = "any" if cfg.data.dataset == "medpix" else "file"  # medpix also reads parquet / datasets folders
    wanted = (("model.hf_config_path", "file"), ("model.tokenizer_path", "dir"), ("data.path", data_kind),
              ("data.validation_path", data_kind), ("checkpoint.initial_load_path", "dir"),
              ("lora.adapter_path", "any"))
    for key, kind in wanted:
        value = _get(cfg, key)
        description, is_right_kind = _PATH_KINDS[kind]
        path = Path(value)
        if value and not is_right_kind(path):
            problem = (f"is a {'folder' if path.is_dir() else 'file'}" if path.exists()
                       else "no such file or folder")
            raise _reject(cfg, key, source_of, problem, f"{description}, or \"\" for the default")
    c = cfg.checkpoint
    _is_a_checkpoint(cfg, source_of)
    is_safetensors = c.initial_load_path and any(Path(c.initial_load_path).glob("*.safetensors"))
    if is_safetensors and not c.initial_load_model_only:
        raise _reject(cfg, "checkpoint.initial_load_model_only", source_of,
                      f"safetensors hold no optimizer state, and "
                      f"{_other(cfg, 'checkpoint.initial_load_path', source_of)} is a safetensors folder",
                      "true")
    if c.initial_load_path and not c.initial_load_model_only:  # it was accepted and ignored
        raise _reject(cfg, "checkpoint.initial_load_model_only", source_of,
                      "loading the optimizer, schedule and data state from checkpoint.initial_load_path is not "
                      "built (only the model weights are read)", "true",
                      "To continue a run with its optimizer state, resume it: checkpoint.enable with that run's "
                      "job.dump_folder and checkpoint.folder (checkpoint.load_step picks the step)")


def output_folders_can_be_created(cfg: JobConfig, source_of: SourceOf) -> None:
    """job.dump_folder and the checkpoint and profile folders under it: folders, or creatable (no file on their
    path)."""
    dump = Path(cfg.job.dump_folder)
    folders = [("job.dump_folder", dump), ("checkpoint.folder", dump / cfg.checkpoint.folder)]
    if cfg.profiling.enable:
        folders.append(("profiling.folder", dump / cfg.profiling.folder))
    for key, path in folders:
        existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
        if existing.exists() and not existing.is_dir():
            where = "is a file" if existing == path else f"cannot be created: {str(existing)!r} is a file"
            raise _reject(cfg, key, source_of, where, "a folder, or a path where one can be created")


def _is_a_checkpoint(cfg: JobConfig, source_of: SourceOf) -> None:
    # The file names of checkpoint/initial.py's format check (a DCP step, or an HF index or model.safetensors).
    folder = cfg.checkpoint.initial_load_path
    if not folder or any((Path(folder) / name).is_file() for name in _CHECKPOINT_MARKERS):
        return
    steps = sorted(p.name for p in Path(folder).glob("step-*") if (p / ".metadata").is_file())
    hint = f"it holds the DCP steps {steps}: name one of them" if steps else None
    raise _reject(cfg, "checkpoint.initial_load_path", source_of,
                  "is neither a DCP checkpoint step (no .metadata) nor an HF folder (no model.safetensors.index.json "
                  "or model.safetensors)", "a DCP step-N folder or an HF safetensors folder", hint)


RULES: tuple[Rule, ...] = (
    lora_settings_need_lora,
    indexer_settings_fit_the_mode,
    medpix_needs_a_vision_tower,
    image_pixel_bounds_are_ordered,
    activation_estimate_is_a_dry_run,
    step_time_estimate_is_a_dry_run,
    weight_prefetch_needs_kept_weights,
    microbatch_gradient_sync_needs_a_pipeline_of_whole_backwards,
    schedule_fits_in_training,
    selective_ac_option_is_known,
    uncheckpointed_blocks_need_checkpointing,
    compile_has_components,
    module_compile_without_checkpointing,
    cuda_graphs_where_they_hold,
    global_batch_is_whole_local_batches,
    context_parallel_kda_has_a_backend,
    mixed_precision_only_lowers,
    fp8_expert_gemms_without_adapters,
    hf_save_is_model_only,
    profiling_steps_are_in_the_run,
    checkpoint_keys_need_checkpointing,
    synthetic_data_takes_no_files,
    input_paths_exist,
    output_folders_can_be_created,
    validation_has_data,
    optimizer_implementation_fits,
)

