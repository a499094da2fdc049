"""Launched by tests/test_parallel.py under torchrun on 4 gloo ranks: for each layout, one step's gradients of
the real Trainer (fp32) against one process computing the whole global batch with the same initial weights.

Prints one line per layout, ``PARITY <name> grad_rel <worst> loss_rel <rel> params <n>``, from rank 0 (every
rank checks its own parameters; the worst error is reduced over ranks).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_kimi.checkpoint import load_model_weights
from titan_kimi.checkpoint.destinations import canonical_fqn
from titan_kimi.config import load_job_config
from titan_kimi.data import build_dataloader
from titan_kimi.models.kimi_k3 import KimiK3Model
from titan_kimi.parallel.distributed import DistEnv
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.train import Trainer
from titan_kimi.training.build import model_args_from_config, tokenizer_from_config
from titan_kimi.training.loss import LinearCrossEntropyLoss
from titan_kimi.training.seeded_init import init_weights_seeded

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
}
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


def reference(cfg, args, global_batch: int):
    """Loss and gradients of one process on the whole global batch, from the Trainer's initial weights."""
    with torch.device("meta"):
        model = KimiK3Model(args)
    model.to_empty(device="cpu")
    init_weights_seeded(model, cfg.job.seed)
    if cfg.checkpoint.initial_load_path:
        load_model_weights(model, cfg.checkpoint.initial_load_path)
    loader = build_dataloader(cfg.data.dataset, cfg.data.path or None, tokenizer_from_config(cfg, args),
                              seq_len=cfg.training.seq_len, local_batch_size=global_batch, dp_rank=0,
                              dp_world_size=1, seed=cfg.job.seed, shuffle=cfg.data.shuffle,
                              vocab_size=args.vocab_size)
    batch = next(iter(loader))
    valid = float((batch["labels"] != -100).sum())
    hidden = model(batch["input_ids"], doc_ids=batch["doc_ids"], return_hidden=True)
    loss = LinearCrossEntropyLoss(cfg.training.loss_chunk_size)(model.output, hidden, batch["labels"], valid)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check(name: str, overrides: list[str], env: DistEnv) -> None:
    cfg = load_job_config([*COMMON, *overrides])
    args = model_args_from_config(cfg)
    layout = resolve_layout(cfg.parallelism, env.world_size, args, local_batch_size=cfg.training.local_batch_size,
                            seq_len=cfg.training.seq_len)
    trainer = Trainer(cfg, args, layout, env)
    ref_loss, ref_grads = reference(cfg, args, trainer.global_batch)
    data = iter(trainer.dataloader)
    host = [trainer._local(next(data)) for _ in range(trainer.accum_steps)]
    normalizer = trainer._global_valid_tokens(host)
    loss = torch.zeros(())
    for batch in host:
        loss += trainer._micro_step(batch, normalizer, backward=True)
    trainer.replicated.sync()
    dist.all_reduce(loss)
    worst, count = 0.0, 0
    for part in trainer.model_parts:
        for fqn, p in part.named_parameters():
            fqn = canonical_fqn(fqn)
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
    stats = torch.tensor([worst, float(count)])
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(stats[1:])
    if env.rank == 0:
        loss_rel = abs(float(loss) - ref_loss) / abs(ref_loss)
        print(f"PARITY {name} grad_rel {float(stats[0]):.3e} loss_rel {loss_rel:.3e} params {int(stats[1])}",
              flush=True)
    trainer.close()


def main() -> None:
    env = DistEnv.from_environ()
    argv = sys.argv[1:]
    hf = argv[argv.index("--hf") + 1] if "--hf" in argv else None
    names = [a for a in argv if a != "--hf" and a != hf]
    for name in names or [*LAYOUTS, *(HF_LAYOUTS if hf else ())]:
        overrides = {**LAYOUTS, **CP_LAYOUTS}.get(name) or [*HF_LAYOUTS[name], "--checkpoint.initial_load_path", hf]
        check(name, overrides, env)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
