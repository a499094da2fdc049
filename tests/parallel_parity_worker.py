"""Launched by tests/test_parallel.py under torchrun on 4 gloo ranks (and by tests/test_multi_gpu.py on 2 NCCL
ranks, one GPU each): for each layout, one step's gradients of the real Trainer (fp32) against one process
computing the whole global batch with the same initial weights, on the Trainer's device (CUDA when there is one).

Prints one line per layout, ``PARITY <name> grad_rel <worst> loss_rel <rel> params <n>``, from rank 0 (every
rank checks its own parameters; the worst error is reduced over ranks). The image-text layouts (``vl_*``) run the
k31_medpix_debug recipe; with LoRA they also check that only adapters get gradients and that the adapters saved
from the pipeline stages are the file one process writes. The layouts in ``HF_EXPORT`` also export their stages
as one HF checkpoint (adapters merged) and check it against one process's export of the same weights.

The name ``cp_layers`` runs tests/cp_layer_worker.py's cases (its ``CP ...`` lines) in this launch instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint import export_hf_checkpoint, export_hf_stages, load_hf_checkpoint, load_model_weights
from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.config import load_job_config
from titan_kimi.data import build_dataloader
from titan_kimi.data.image_processor import ImageProcessor
from titan_kimi.lora import is_adapter_parameter, merged_tensors, save_adapters
from titan_kimi.training.process.distributed import DistEnv, init_distributed
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.trainer import Trainer
from titan_kimi.training.setup.build import build_model_from_config, model_args_from_config, tokenizer_from_config
from titan_kimi.training.loss import LinearCrossEntropyLoss
from titan_kimi.training.setup.seeded_init import init_weights_seeded

import cp_layer_worker
from test_checkpoint_hf_stages import assert_same_checkpoint, fill_adapters, logits_with_an_image
from tests.worker_exit import run_and_exit

GLOBAL_BATCH = 8
COMMON = ["--job.config_file", "train_configs/k31_debug.toml", "--model.flavor", "k31_debug_pp",
          "--model.dtype", "float32", "--training.mixed_precision", "false", "--training.seq_len", "32",
          "--training.steps", "2", "--lr_scheduler.warmup_steps", "0", "--data.shuffle", "false",
          "--training.global_batch_size", str(GLOBAL_BATCH), "--metrics.save_jsonl", "false"]
LAYOUTS = {
    "ep2": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    "pp2_1f1b": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    "pp2_interleaved": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    "pp2_zbv": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
    "pp2_ep2_fsdp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                      "--training.local_batch_size", "2", "--training.global_batch_size", "4"],
    # every FSDP unit gathered when the step begins (from the second step on): the same gradients
    "pp2_ep2_fsdp2_prefetch": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                               "2", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                               "--parallelism.pipeline_prefetch_weights", "true"],
    "pp2_interleaved_zb": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                           "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"],
    "pp2_looped_bfs": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                       "--parallelism.pipeline_parallel_schedule", "LoopedBFS"],
    "pp2_dualpipev": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                      "--parallelism.pipeline_parallel_schedule", "DualPipeV"],
    "pp2_gpipe": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                  "--parallelism.pipeline_parallel_schedule", "GPipe"],
    # Activation checkpointing (per-op selective: KDA, sparse attention and expert GEMM outputs kept) and
    # per-block compile, both applied after expert parallelism, under the pipeline.
    "pp2_ep2_sac_compile": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                            "2", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                            "--activation_checkpoint.mode", "selective", "--compile.mode", "default"],
    "ep2_full_ac": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                    "--activation_checkpoint.mode", "full"],
    # Rows moved node by node (4 ranks as 2 nodes of 2: each token crosses once per node holding one of its
    # experts), under full checkpointing, whose recompute runs the two levels again.
    "ep4_hierarchical_full_ac": ["--parallelism.expert_parallel_degree", "4", "--parallelism.expert_parallel_dispatch",
                                 "hierarchical", "--parallelism.expert_parallel_node_size", "2",
                                 "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"],
    # and under per-op selective checkpointing with the MoE blocks' sub-modules compiled around the routed path
    "ep4_hierarchical_sac_compile": ["--parallelism.expert_parallel_degree", "4",
                                     "--parallelism.expert_parallel_dispatch", "hierarchical",
                                     "--parallelism.expert_parallel_node_size", "2", "--training.local_batch_size", "2",
                                     "--activation_checkpoint.mode", "selective", "--compile.mode", "default"],
    # Norms, attention and FFN compiled apart (compile.granularity = module), inside FSDP2 units, under PP2.
    "pp2_fsdp2_module_compile": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
                                 "--training.global_batch_size", "4", "--compile.mode", "default",
                                 "--compile.granularity", "module"],
}
# One step of a layout under two settings, compared with each other (``AB name grad_rel .. loss_rel .. held A B``;
# held: the most unsharded gradient elements a rank's FSDP units kept after a backward): gradients reduce-scattered
# in every microbatch's backward against once after the last, 4 microbatches, with the precision k31_debug ships
# (fp32 weights, bf16 compute, fp32 reduction), also freeing the gathered weights after each backward; and with bf16
# weights (k31.toml), where the sharded gradient sums the microbatches in bf16.
PP2_EP2_FSDP2_MB4 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                     "--training.local_batch_size", "4"]
MIXED = [*PP2_EP2_FSDP2_MB4, "--training.mixed_precision", "true"]
SYNC = ["--parallelism.pipeline_gradient_sync", "microbatch"]
AB_LAYOUTS = {
    "pp2_ep2_fsdp2_sync_microbatch": (MIXED, SYNC),
    "pp2_ep2_fsdp2_sync_microbatch_always": (MIXED, [*SYNC, "--parallelism.fsdp_reshard_after_forward", "always"]),
    "pp2_ep2_fsdp2_sync_microbatch_bf16": ([*PP2_EP2_FSDP2_MB4, "--model.dtype", "bfloat16"], SYNC),
}
# Layouts whose feature starts at the second step: one warm step on the same batch first (no optimizer step).
WARM_STEP = ("pp2_ep2_fsdp2_prefetch",)
# The image-text recipe in fp32 (pipeline x FSDP over the 4 ranks): the tower and projector on the first stage;
# with LoRA, adapters on the tower and projector too.
VL = ["--job.config_file", "train_configs/k31_medpix_debug.toml", "--model.dtype", "float32",
      "--training.mixed_precision", "false", "--training.steps", "2", "--lr_scheduler.warmup_steps", "0",
      "--data.shuffle", "false", "--training.global_batch_size", str(GLOBAL_BATCH), "--metrics.save_jsonl", "false",
      "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
VL_LAYOUTS = {
    "vl_pp2_fsdp2": VL,
    "vl_lora_pp2_fsdp2": [*VL, "--lora.enable", "true", "--lora.target_modules",
                          "attention,experts,lm_head,projector,vision_tower"],
    # Two stages per rank in a V (rank 0 runs the first stage and the last): 2-layer blocks.
    "vl_lora_pp2_zbv": [*VL, "--model.flavor", "k31_debug_pp", "--parallelism.pipeline_parallel_schedule",
                        "ZBVZeroBubble", "--lora.enable", "true", "--lora.target_modules",
                        "attention,experts,projector,vision_tower"],
}
# Layouts whose stages also export one HF checkpoint: text PP2 x EP2 x FSDP2, image-text PP2 x FSDP2 with LoRA
# merged, and two stages per rank (ZBV).
HF_EXPORT = ("pp2_ep2_fsdp2", "vl_lora_pp2_fsdp2", "vl_lora_pp2_zbv")
# With an HF checkpoint (argument --hf PATH): every rank reads only its own keys and boxes (pipeline stages,
# FSDP shards, expert shards of an efsdp 2 x ep 2 mesh) as initial weights.
HF_LAYOUTS = {
    "ep2_efsdp2_hf": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    "pp2_ep2_hf": LAYOUTS["pp2_ep2_fsdp2"],
}
# Context parallelism (tests/test_context_parallel.py): 64-token sequences, so that the indexer's top-32 leaves
# keys unselected and zigzag over 4 ranks still gives 8-token pieces.
CP = ["--training.seq_len", "64"]
CP_LAYOUTS = {
    "cp2_dp2": [*CP, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"],
    "cp2_contiguous_dp2": [*CP, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4",
                           "--parallelism.context_parallel_layout", "contiguous"],
    "cp4": [*CP, "--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8"],
    "cp2_pp2": [*CP, "--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                "--training.local_batch_size", "8"],
    "cp2_ep2_dp2": [*CP, "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                    "--training.local_batch_size", "4"],
    "cp2_pp2_ep2": [*CP, "--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "8"],
}
# Indexer training (tests/test_indexer_training_parallel.py): 64-token rows, so k31_debug's top-32 selects; the
# KL's gradient reaches the indexer through each stage's own layers and is normalised over the whole step.
INDEXER_LAYOUTS = {
    "sparse_pp2_ep2_fsdp2": [*CP, "--indexer.mode", "sparse", "--parallelism.pipeline_parallel_degree", "2",
                             "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "4"],
    "sparse_cp2_dp2_sac": [*CP, "--indexer.mode", "sparse", "--parallelism.context_parallel_degree", "2",
                           "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective"],
    "warmup_cp2_pp2": [*CP, "--indexer.mode", "warmup", "--parallelism.context_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"],
    # the attention modules compiled (fullgraph) with the KL inside, under FSDP2 x EP2
    "sparse_ep2_module_compile": [*CP, "--indexer.mode", "sparse", "--parallelism.expert_parallel_degree", "2",
                                  "--training.local_batch_size", "2", "--compile.mode", "default",
                                  "--compile.granularity", "module"],
}


def distillation_kl(model) -> float:
    """The mean KL per query and DSA layer a model's indexers counted (distillation_stats), on this process."""
    stats = sum(m.distillation_stats for n, m in model.named_modules() if n.endswith(".indexer"))
    return float(stats[0] / stats[1])


def reference(cfg, args, global_batch: int, tokenizer, device: torch.device):
    """Loss, gradients and the model of one process on the whole global batch, from the Trainer's initial weights."""
    model = build_model_from_config(cfg, args, tokenizer)  # on meta; image-text and LoRA as the config says
    model.to_empty(device=device)
    init_weights_seeded(model, cfg.job.seed)
    for name, module in model.named_buffers():
        if name.endswith("distillation_stats"):
            module.zero_()
    if cfg.checkpoint.initial_load_path:
        load_model_weights(model, cfg.checkpoint.initial_load_path)
    vision = getattr(model, "vision_args", None)
    processor = (ImageProcessor(patch_size=vision.patch_size, merge_kernel=vision.merge_kernel,
                                min_pixels=cfg.data.image_min_pixels, max_pixels=cfg.data.image_max_pixels)
                 if vision is not None else None)
    loader = build_dataloader(cfg.data.dataset, cfg.data.path or None, tokenizer,
                              seq_len=cfg.training.seq_len, local_batch_size=global_batch, dp_rank=0,
                              dp_world_size=1, seed=cfg.job.seed, shuffle=cfg.data.shuffle,
                              vocab_size=args.vocab_size, image_processor=processor)
    batch = {k: v.to(device) for k, v in next(iter(loader)).items()}
    valid = float((batch["labels"] != -100).sum())
    images = {k: batch[k] for k in ("pixel_values", "grid_thws") if k in batch}
    # indexer_metrics: a training indexer counts its KL (in the sparse stage only on measured forwards)
    hidden = model(batch["input_ids"], doc_ids=batch["doc_ids"], return_hidden=True, indexer_metrics=True, **images)
    loss = LinearCrossEntropyLoss(cfg.training.loss_chunk_size)(model.output, hidden, batch["labels"], valid)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


# One process's reference depends on the model, the data, the precision and the global batch, not on how the ranks
# split the work: layouts whose arguments differ only in these options share one reference (loss, gradients, the
# indexers' KL), computed by the first of them and kept for the launch. The LoRA and HF-export checks also use the
# reference model itself, which they change, so they build their own.
SPLIT_ONLY = ("--parallelism.", "--training.local_batch_size", "--activation_checkpoint.", "--compile.")
_REFERENCES: dict[tuple, tuple[float, dict[str, torch.Tensor], float | None]] = {}


def shared_reference(argv: list[str], cfg, args, trainer, device: torch.device):
    """`reference`'s loss and gradients, and the indexers' KL (None when the run does not train them), of the
    first layout with these arguments but for ``SPLIT_ONLY``."""
    assert all(flag.startswith("--") for flag in argv[::2]), argv  # flag, value pairs
    key = (trainer.global_batch, *((flag, value) for flag, value in zip(argv[::2], argv[1::2])
                                   if not flag.startswith(SPLIT_ONLY)))
    if key not in _REFERENCES:
        loss, grads, model = reference(cfg, args, trainer.global_batch, trainer.tokenizer, device)
        _REFERENCES[key] = (loss, grads, distillation_kl(model) if trainer.indexer_metrics is not None else None)
    return _REFERENCES[key]


def check_adapter_files(name: str, trainer, reference_model, env: DistEnv) -> None:
    """The adapters the pipeline stages save (before any optimizer step: the seeded initial values) are, byte for
    byte, the files one process writes."""
    folder = Path(tempfile.gettempdir()) / f"titan_kimi_parity_{os.getppid()}" / name  # one torchrun, one folder
    targets = trainer.cfg.lora.target_modules
    save_adapters(trainer.model_parts, folder / "pipeline", targets=targets, group=trainer.meshes.pp_group)
    save_adapters(reference_model, folder / "single", targets=targets)  # every rank holds it; rank 0 writes
    if env.rank == 0:
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            a, b = (folder / "pipeline" / file).read_bytes(), (folder / "single" / file).read_bytes()
            assert a == b, f"{name}: {file} differs from the one-process file"
        shutil.rmtree(folder)
    dist.barrier()


def check_hf_export(name: str, argv: list[str], trainer, reference_model, env: DistEnv) -> None:
    """The stages' HF export (adapters non-zero and merged) is one process's export of the same weights: same
    keys, equal tensors, index total and config.json; it loads into a one-process model with its logits."""
    folder = Path(tempfile.gettempdir()) / f"titan_kimi_parity_{os.getppid()}" / f"{name}_hf"
    lora = trainer.cfg.lora.enable
    if lora:
        for model in [*trainer.model_parts, reference_model]:
            fill_adapters(model, trainer.cfg.job.seed)
    export_hf_stages(trainer.model_parts, folder / "pipeline", group=trainer.meshes.pp_group, dtype=torch.float32,
                     tensors_of=merged_tensors if lora else None)
    export_hf_checkpoint(reference_model, folder / "single", dtype=torch.float32,  # every rank calls; rank 0 writes
                         tensors=merged_tensors(reference_model) if lora else None)
    if env.rank == 0:
        assert_same_checkpoint(folder / "pipeline", folder / "single")
        cfg = load_job_config([*argv, "--lora.enable", "false"], environ={})  # the model without adapters
        plain = build_model_from_config(cfg, trainer.args, trainer.tokenizer)
        plain.to_empty(device="cpu")
        load_hf_checkpoint(plain, folder / "pipeline")
        ours, reference = logits_with_an_image(plain), logits_with_an_image(reference_model)
        assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-5) if lora else torch.equal(ours, reference), name
        print(f"HF_EXPORT {name} ok files {len(list((folder / 'pipeline').glob('*.safetensors')))}", flush=True)
        shutil.rmtree(folder)
    dist.barrier()


def check(name: str, overrides: list[str], env: DistEnv) -> None:
    argv = overrides if name in VL_LAYOUTS else [*COMMON, *overrides]
    cfg = load_job_config(argv)
    args = model_args_from_config(cfg)
    layout = resolve_layout(cfg, env.world_size, args)
    trainer = Trainer(cfg, args, layout, env)
    device = trainer.device
    if cfg.lora.enable or name in HF_EXPORT:
        ref_loss, ref_grads, ref_model = reference(cfg, args, trainer.global_batch, trainer.tokenizer, device)
        ref_kl = distillation_kl(ref_model) if trainer.indexer_metrics is not None else None
    else:
        ref_loss, ref_grads, ref_kl = shared_reference(argv, cfg, args, trainer, device)
    if cfg.lora.enable:
        check_adapter_files(name, trainer, ref_model, env)
    data = iter(trainer.dataloader)
    host = [trainer._local(next(data)) for _ in range(trainer.accum_steps)]
    valid = trainer._step_totals(host)[0]  # as the trainer's step: a host number, a device scalar without PP
    normalizer = valid if trainer.pipeline is not None else torch.full((), valid, dtype=torch.float32, device=device)
    indexer = trainer._indexer_inputs(host, measure=True)  # the KL's value is compared below
    for run in range(2 if name in WARM_STEP else 1):  # the compared gradients: the last run's
        for part in trainer.model_parts:
            part.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        for batch in host:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss += trainer._micro_step(batch, normalizer, backward=True, indexer=indexer)
    trainer.replicated.sync()
    dist.all_reduce(loss)
    worst, count = 0.0, 0
    for part in trainer.model_parts:
        for fqn, p in part.named_parameters():
            fqn = canonical_fqn(fqn)
            if cfg.lora.enable:
                assert p.grad is None or is_adapter_parameter(fqn), f"{name}: frozen {fqn} has a gradient"
            if fqn not in ref_grads:
                assert p.grad is None or not p.grad.to_local().any() if isinstance(p.grad, DTensor) else True
                continue
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            ref = ref_grads[fqn]
            err = float((grad - ref).norm() / ref.norm().clamp(min=1e-30))
            if os.environ.get("PARITY_VERBOSE") and err > 1e-4:
                print(f"rank {env.rank} {name} {fqn} rel {err:.3e} {type(p).__name__} {p.shape}", flush=True)
            worst = max(worst, err)
            count += 1
    stats = torch.tensor([worst, float(count)], device=device)  # NCCL reduces device tensors only
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(stats[1:])
    if env.rank == 0:
        loss_rel = abs(float(loss) - ref_loss) / abs(ref_loss)
        print(f"PARITY {name} grad_rel {float(stats[0]):.3e} loss_rel {loss_rel:.3e} params {int(stats[1])}",
              flush=True)
    if trainer.indexer_metrics is not None:
        kl = trainer.indexer_metrics.read_and_reset().kl
        if env.rank == 0:
            print(f"INDEXER {name} kl_rel {abs(kl - ref_kl) / ref_kl:.3e}", flush=True)
    if name in HF_EXPORT:  # after the gradients: no optimizer step ran, the weights are still the seeded ones
        check_hf_export(name, argv, trainer, ref_model, env)
    trainer.close()


def unsharded_grad_elements(modules) -> int:
    """Elements of the unsharded gradients (accumulated or not) FSDP's units hold now."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    held = 0
    for module in modules:
        for sub in module.modules():
            group = fully_shard.state(sub)._fsdp_param_group if isinstance(sub, FSDPModule) else None
            for p in group.fsdp_params if group else ():
                if p.unsharded_accumulated_grad is not None:
                    held += p.unsharded_accumulated_grad.numel()
                elif hasattr(p, "_unsharded_param") and p._unsharded_param.grad is not None:
                    held += p._unsharded_param.grad.numel()
    return held


def step_grads(argv: list[str], env: DistEnv) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, full gradients and the most unsharded gradient elements held after a stage backward, of one step."""
    cfg = load_job_config(argv)
    args = model_args_from_config(cfg)
    trainer = Trainer(cfg, args, resolve_layout(cfg, env.world_size, args), env)
    held = [0]
    for stage in trainer.pipeline.stages:
        def backward(*a, _run=stage.backward_maybe_with_nosync, **k):
            out = _run(*a, **k)
            held[0] = max(held[0], unsharded_grad_elements(trainer.pipeline.modules))
            return out
        stage.backward_maybe_with_nosync = backward
    data = iter(trainer.dataloader)
    host = [trainer._local(next(data)) for _ in range(trainer.accum_steps)]
    valid = trainer._step_totals(host)[0]
    loss = torch.zeros((), device=trainer.device)
    for batch in host:
        loss += trainer._micro_step({k: v.to(trainer.device) for k, v in batch.items()}, valid, backward=True)
    trainer.replicated.sync()
    dist.all_reduce(loss)
    grads = {canonical_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().clone()
             for part in trainer.model_parts for n, p in part.named_parameters() if p.grad is not None}
    trainer.close()
    return float(loss), grads, held[0]


_BASE_STEPS: dict[tuple[str, ...], tuple[float, dict[str, torch.Tensor], int]] = {}


def check_ab(name: str, env: DistEnv) -> None:
    base, variant = AB_LAYOUTS[name]
    key = (*COMMON, *base)  # layouts sharing a base step build and run it once
    if key not in _BASE_STEPS:
        _BASE_STEPS[key] = step_grads(list(key), env)
    loss_a, grads_a, held_a = _BASE_STEPS[key]
    loss_b, grads_b, held_b = step_grads([*COMMON, *base, *variant], env)
    assert grads_a.keys() == grads_b.keys(), name
    worst = max(float((grads_b[k] - g).norm() / g.norm().clamp(min=1e-30)) for k, g in grads_a.items())
    stats = torch.tensor([worst, float(held_a), float(held_b)], device=next(iter(grads_a.values())).device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if env.rank == 0:
        print(f"AB {name} grad_rel {float(stats[0]):.3e} loss_rel {abs(loss_b - loss_a) / abs(loss_a):.3e} "
              f"held {int(stats[1])} {int(stats[2])}", flush=True)


def main() -> None:
    env = DistEnv.from_environ()
    argv = sys.argv[1:]
    hf = argv[argv.index("--hf") + 1] if "--hf" in argv else None
    names = [a for a in argv if a != "--hf" and a != hf]
    for name in names or [*LAYOUTS, *VL_LAYOUTS, *(HF_LAYOUTS if hf else ())]:
        if name == "cp_layers":
            init_distributed(env, torch.device("cpu"))  # as the Trainer would (gloo), if no layout ran before
            cp_layer_worker.run_all(torch.device("cpu"))
            continue
        if name in AB_LAYOUTS:
            check_ab(name, env)
            continue
        overrides = ({**LAYOUTS, **CP_LAYOUTS, **VL_LAYOUTS, **INDEXER_LAYOUTS}.get(name)
                     or [*HF_LAYOUTS[name], "--checkpoint.initial_load_path", hf])
        check(name, overrides, env)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_and_exit(main)
