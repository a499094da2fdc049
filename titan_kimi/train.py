"""Entry point: ``torchrun --nproc-per-node=N -m titan_kimi.train --job.config_file train_configs/<recipe>.toml``.

config -> model -> parallelize -> data -> loop -> metrics -> checkpoints.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from titan_kimi.checkpoint import CheckpointManager, export_hf_checkpoint, load_model_weights, training_state
from titan_kimi.config import load_job_config, to_toml, validate_job_config
from titan_kimi.data import IGNORE_INDEX, build_dataloader
from titan_kimi.models.kimi_k3 import KimiK3Model, count_params, training_flops_per_token
from titan_kimi.parallel.distributed import DistEnv, all_reduce_sum, destroy, init_distributed, pick_device
from titan_kimi.parallel.layout import ParallelLayout, reject_unbuilt, resolve_layout
from titan_kimi.dtypes import DTYPES
from titan_kimi.training.build import build_meta_model, model_args_from_config, tokenizer_from_config
from titan_kimi.training.exit_codes import run_cli
from titan_kimi.training.kernels import configure_kernels
from titan_kimi.training.kernels import describe as describe_kernels
from titan_kimi.training.grad_clip import NonFiniteGradientError, clip_gradients
from titan_kimi.training.metrics import MetricsLogger, StepMetrics, peak_memory_gib, setup_logging
from titan_kimi.training.optimizer import build_lr_scheduler, build_optimizer
from titan_kimi.training.seeded_init import init_weights_seeded
from titan_kimi.training.shutdown import StopRequest, stop_run

logger = logging.getLogger("titan_kimi")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)


def dry_run(cfg, args, layout: ParallelLayout) -> None:
    """Build on the meta device, check the layout, print the resolved config and the parameter counts."""
    model = build_meta_model(args, DTYPES[cfg.model.dtype], freeze_indexer=cfg.model.freeze_indexer)
    counts = count_params(model)
    print(to_toml(cfg))
    print(f"# layout: {layout.describe()}")
    print(f"# model: {cfg.model.flavor if not cfg.model.hf_config_path else cfg.model.hf_config_path}, "
          f"{args.n_layers} layers, flops/token {training_flops_per_token(args, cfg.training.seq_len, counts):.4g}")
    print(f"params total={counts.total} active={counts.active}")


class Trainer:
    def __init__(self, cfg, args, layout: ParallelLayout, env: DistEnv) -> None:
        self.cfg, self.args, self.layout, self.env = cfg, args, layout, env
        self.device = pick_device(env)
        init_distributed(env, self.device)
        seed_everything(cfg.job.seed, cfg.job.deterministic)
        self.dump = Path(cfg.job.dump_folder)
        t = cfg.training
        self.dp = layout.dp
        self.global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * self.dp
        if self.global_batch % (t.local_batch_size * self.dp):
            raise ValueError(
                f"training.global_batch_size = {self.global_batch} must be a multiple of local_batch_size x "
                f"data-parallel degree = {t.local_batch_size} x {self.dp}"
            )
        self.accum_steps = self.global_batch // (t.local_batch_size * self.dp)

        self.tokenizer = tokenizer_from_config(cfg, args)
        self.model = self._build_model()
        self.counts = count_params(self.model)
        self.flops_per_token = training_flops_per_token(args, t.seq_len, self.counts)
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer([self.model], cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.dataloader = self._build_dataloader(cfg.data.path, seed=cfg.job.seed, shuffle=cfg.data.shuffle)
        self.validation_loader = self._build_validation_loader() if cfg.validation.enable else None
        # Every validation starts from the first batch, so runs that stop at validation.steps stay comparable.
        self.validation_start = self.validation_loader.state_dict() if self.validation_loader else None
        self.step = 0
        self.checkpointer = CheckpointManager.from_config(cfg.checkpoint, cfg.job.dump_folder)
        self.train_state = training_state(self.model, self.optimizer, self.lr_scheduler, self.dataloader)
        self._restore()
        self.metrics = MetricsLogger(
            self.dump, cfg.metrics.log_freq, cfg.metrics.save_jsonl, cfg.metrics.enable_tensorboard,
            cfg.metrics.progress, t.steps, is_main=env.is_main,
        )
        logger.info("%s | %s | params total=%d active=%d | global batch %d = %d ranks x %d x %d accumulation",
                    cfg.model.flavor, layout.describe(), self.counts.total, self.counts.active,
                    self.global_batch, self.dp, t.local_batch_size, self.accum_steps)

    # ------------------------------------------------------------------ setup
    def _build_model(self) -> KimiK3Model:
        """Build on the meta device, parallelise, then materialise each rank's part and initialise it with the
        seeded init (training/seeded_init.py): every layout starts from the weights of one process."""
        cfg = self.cfg
        model = build_meta_model(self.args, DTYPES[cfg.model.dtype], freeze_indexer=cfg.model.freeze_indexer)
        distributed = self.env.launched and self.env.world_size > 1
        self.autocast_dtype = None
        if distributed:
            from titan_kimi.parallel.parallelize import parallelize

            parallelize(model, cfg, self.layout, self.device)
        else:
            from titan_kimi.parallel.parallelize import apply_single_device

            self.autocast_dtype = apply_single_device(model, cfg)
        model.to_empty(device=self.device)
        init_weights_seeded(model, cfg.job.seed)  # seeded per parameter, not per rank
        model.train()
        return model

    def _build_dataloader(self, path: str, *, seed: int, shuffle: bool, infinite: bool = True, split: str = "train"):
        dataset = self.cfg.data.dataset
        if dataset == "medpix":
            raise ValueError(
                "data.dataset = 'medpix' needs the vision tower, which titan_kimi does not build yet; "
                "valid now: packed_text, hellaswag, synthetic"
            )
        t = self.cfg.training
        return build_dataloader(
            dataset, path or None, self.tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=self.env.rank if self.env.launched else 0, dp_world_size=self.dp, seed=seed,
            shuffle=shuffle, infinite=infinite, vocab_size=self.args.vocab_size, split=split,
        )

    def _build_validation_loader(self):
        """One pass over the validation data per ``iter()``; built once (tokenising is the expensive part)."""
        # data.validation_path = "" is the bundled sample's validation split (config rules require data.path = "").
        return self._build_dataloader(self.cfg.data.validation_path, seed=self.cfg.job.seed + 1, shuffle=False,
                                      infinite=False, split="validation")

    def _restore(self) -> None:
        """Resume from the latest (or ``checkpoint.load_step``) checkpoint; else start from
        ``checkpoint.initial_load_path`` (HF safetensors or a DCP folder) when given."""
        cfg = self.cfg.checkpoint
        restored = self.checkpointer.load(self.train_state) if cfg.enable else None
        if restored is not None:
            self.step = restored
            logger.info("resumed from %s at step %d", self.checkpointer.step_dir(restored), restored)
        elif cfg.initial_load_path:
            fmt = load_model_weights(self.model, cfg.initial_load_path)
            logger.info("initial weights from %s (%s)", cfg.initial_load_path, fmt)

    def _final_save(self) -> None:
        """The last step: the full training state, only the model (``last_save_model_only``), or an HF
        safetensors export in ``export_dtype`` (``last_save_in_hf``). A last step that is also due as an
        interval save is saved resumable as well, so that the run can be extended from it."""
        cfg = self.cfg.checkpoint
        if not cfg.enable:
            return
        if self.checkpointer.should_save(self.step) or not (cfg.last_save_model_only or cfg.last_save_in_hf):
            self.checkpointer.save(self.step, self.train_state, force=True)
        elif not cfg.last_save_in_hf:
            self.checkpointer.save(self.step, {"model": self.model}, force=True)
        if cfg.last_save_in_hf:
            path = self.checkpointer.folder / f"hf-step-{self.step}"
            export_hf_checkpoint(self.model, path, dtype=DTYPES[cfg.export_dtype], overwrite=True)
            logger.info("exported HF safetensors to %s", path)

    # ------------------------------------------------------------------ one step
    def _forward_loss(self, batch: dict, normalizer: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
               else torch.autocast(self.device.type, enabled=False))
        with ctx:
            return self.model(
                batch["input_ids"], doc_ids=batch["doc_ids"], labels=batch["labels"],
                loss_normalizer=normalizer, loss_chunk_size=self.cfg.training.loss_chunk_size,
            )

    def train_step(self, data_iter) -> StepMetrics:
        cfg, t0 = self.cfg, time.perf_counter()
        batches = [{k: v.to(self.device) for k, v in next(data_iter).items()} for _ in range(self.accum_steps)]
        local_valid = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        # The loss of every micro-batch on every rank is divided by the step's global count of valid tokens.
        global_valid = all_reduce_sum(torch.as_tensor(local_valid, dtype=torch.float32, device=self.device))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch in batches:
            loss = self._forward_loss(batch, global_valid)
            loss.backward()
            loss_sum += loss.detach()
        loss_value = float(all_reduce_sum(loss_sum))
        clip = clip_gradients(self.named_params, cfg.training.max_norm)
        skipped = not clip.finite
        if skipped:
            message = f"step {self.step}: non-finite gradients (norm {clip.grad_norm}) in {clip.report}"
            if cfg.training.nonfinite_grad_policy == "stop":
                raise NonFiniteGradientError(message + "; training.nonfinite_grad_policy = 'stop'")
            logger.warning("%s; skipping the optimizer step (training.nonfinite_grad_policy = 'skip')", message)
        else:
            self.optimizer.step()
        lr = self.lr_scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # A skipped step still advances the schedule; torch warns when no optimizer step preceded it.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        tokens = self.global_batch * cfg.training.seq_len  # processed tokens, padding included
        per_device = tokens / dt / self.layout.world_size
        return StepMetrics(
            step=self.step, loss=loss_value, grad_norm=clip.grad_norm, lr=lr, tokens=tokens, step_time=dt,
            tokens_per_sec=tokens / dt, tokens_per_sec_per_device=per_device,
            mfu=per_device * self.flops_per_token / cfg.metrics.peak_flops,
            peak_mem_gib=peak_memory_gib(self.device), skipped=skipped,
        )

    @torch.no_grad()
    def validate(self) -> None:
        cfg = self.cfg
        self.validation_loader.load_state_dict(self.validation_start)
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, batch in enumerate(self.validation_loader):
            if cfg.validation.steps != -1 and i >= cfg.validation.steps:
                break
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += self._forward_loss(batch, torch.ones((), device=self.device))
            count += (batch["labels"] != IGNORE_INDEX).sum()
        total, count = all_reduce_sum(total), all_reduce_sum(count)
        self.model.train()
        self.metrics.log_validation(self.step, float(total / count.clamp(min=1)), int(count))

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        gc.disable()
        data_iter = iter(self.dataloader)
        stop = StopRequest(self.device).install()  # SIGTERM/SIGINT: finish the step, save, exit 128 + signal
        try:
            while self.step < cfg.training.steps:
                self.step += 1
                metrics = self.train_step(data_iter)
                self.metrics.log(metrics)
                if not math.isfinite(metrics.loss):
                    raise NonFiniteGradientError(f"step {self.step}: the loss is {metrics.loss}")
                if cfg.validation.enable and self.step % cfg.validation.freq == 0:
                    self.validate()
                if self.step < cfg.training.steps:
                    saved = self.checkpointer.save(self.step, self.train_state)
                    if signum := stop.agreed():
                        raise stop_run(signum, self.step, cfg.training.steps, self.checkpointer, self.train_state,
                                       saved=saved)
                if self.step % cfg.training.gc_freq == 0:
                    gc.collect()
            self._final_save()
        finally:
            stop.restore()
            gc.enable()
        logger.info(self.metrics.summary())

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    cfg = load_job_config(sys.argv[1:] if argv is None else argv)
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)
    args = model_args_from_config(cfg)
    world_size = cfg.job.world_size or env.world_size
    if not cfg.job.world_size and "WORLD_SIZE" not in os.environ:
        validate_job_config(cfg, launcher_world_size=world_size)  # a plain process: check against 1 rank
    layout = resolve_layout(cfg.parallelism, world_size, args)
    if cfg.job.print_config and env.is_main and not cfg.job.dry_run:
        print(to_toml(cfg))
    if cfg.job.dry_run:
        if env.is_main:
            dry_run(cfg, args, layout)
        return 0
    reject_unbuilt(layout)
    if world_size != env.world_size:
        raise ValueError(f"job.world_size = {world_size} but the launcher started {env.world_size} processes")
    resolved = configure_kernels(cfg.kernels)
    logger.info("kernels: %s", describe_kernels(resolved))
    trainer = Trainer(cfg, args, layout, env)
    try:
        if resolved["kda"] == "fla":  # after Trainer set the device; before the first step imports fla
            from lowerings.kernels.fla_kda import prepare_fla_configs  # kernels.fla_configs

            logger.info(prepare_fla_configs())
        trainer.train()
    finally:
        trainer.close()
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
