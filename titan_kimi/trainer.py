"""The trainer that ``python -m titan_kimi.train`` runs (titan_kimi/train.py starts it).

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
from typing import NamedTuple

import numpy as np
import torch

from titan_kimi.compile.kernel_prewarm import FlaPrewarm
from titan_kimi.checkpoint import (CheckpointManager, ModelState, export_hf_checkpoint, export_hf_stages,
                                   load_model_weights, training_state)
from titan_kimi.config import load_job_config, to_toml, validate_job_config
from titan_kimi.data import IGNORE_INDEX
from titan_kimi.data.causal_keys import longest_document
from titan_kimi.data.trim import trim_padding
from titan_kimi.lora import load_adapters, merged_tensors, save_adapters
from titan_kimi.models.kimi_k3 import KimiK3Model, count_params, training_flops_per_token
from titan_kimi.models.kimi_k3.accounting import routed_expert_flops_per_token
from titan_kimi.models.kimi_k3.multimodal import VISION_PREFIXES, KimiK3VLModel
from titan_kimi.models.kimi_k3.vision_accounting import vision_flops
from titan_kimi.parallel.context_parallel import ContextParallel
from titan_kimi.parallel.fsdp import ReplicatedGradients
from titan_kimi.parallel.layout import ParallelLayout, resolve_layout
from titan_kimi.parallel.mesh import Meshes, build_meshes
from titan_kimi.dtypes import DTYPES
from titan_kimi.compile.cache_dir import use_compile_cache_dir
from titan_kimi.compile.report import CompileReport
from titan_kimi.training.process.distributed import (DistEnv, all_reduce_sum, destroy, host_all_reduce,
                                                     init_distributed, pick_device)
from titan_kimi.training.reports.startup import StartupClock
from titan_kimi.compile.module_prewarm import ModulePrewarm
from titan_kimi.compile.module_prewarm import unsupported as prewarm_unsupported
from titan_kimi.training.setup.build import (build_model_from_config, dataloader_from_config, model_args_from_config,
                                             tokenizer_from_config, vision_args_from_config)
from titan_kimi.training.reports.indexer_metrics import IndexerMetrics
from titan_kimi.training.setup.indexer_training import indexer_step_inputs
from titan_kimi.training.setup.kernels import check_routed_expert_gemm, configure_kernels, import_backend_libraries
from titan_kimi.training.setup.kernels import describe as describe_kernels
from titan_kimi.training.loss import LinearCrossEntropyLoss
from titan_kimi.training.optim.grad_clip import NonFiniteGradientError, clip_gradients
from titan_kimi.training.reports.metrics import MetricsLogger, StepMetrics, peak_memory_gib, setup_logging
from titan_kimi.training.optim.optimizer import OptimizerParts, SchedulerParts, build_lr_scheduler, build_optimizer
from titan_kimi.training.reports.profiling import StepProfiler, gather_profiles
from titan_kimi.training.reports.router_load import RouterLoad, load_of
from titan_kimi.training.setup.seeded_init import init_weights_seeded
from titan_kimi.training.process.shutdown import StopRequest, stop_run

logger = logging.getLogger("titan_kimi")


class StepTotals(NamedTuple):
    """A step's sums over every rank (`Trainer._step_totals`)."""

    valid: float  # tokens with a label: the loss normaliser
    images: int
    flops: float  # model FLOPs of the work that runs (text and tower)
    tokens: int  # tokens the model runs, padding included


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)


def dry_run(cfg, args, layout: ParallelLayout) -> None:
    """Build on the meta device, check the layout, print the resolved config, the stage split, the parameter
    counts and the per-rank estimate.

    An image-text model's ``total`` includes the tower and projector (also printed as ``vision=``); ``active``
    counts the text model per token (the tower runs per image patch)."""
    from titan_kimi.parallel.estimate import describe_ranks

    model = build_model_from_config(cfg, args, tokenizer_from_config(cfg, args))
    counts = count_params(model)
    text = count_params(model, skip_prefixes=VISION_PREFIXES)
    print(to_toml(cfg))
    print(f"# layout: {layout.describe()}")
    for line in layout.pipeline.describe() if layout.pipeline is not None else ():
        print(f"# {line}")
    tower = f" + {cfg.model.vision_flavor or 'the config'}'s vision tower" if isinstance(model, KimiK3VLModel) else ""
    flops = training_flops_per_token(args, cfg.training.seq_len, text, frozen_backward=cfg.lora.enable)
    print(f"# model: {cfg.model.flavor if not cfg.model.hf_config_path else cfg.model.hf_config_path}{tower}, "
          f"{args.n_layers} layers, flops/token {flops:.4g}")
    if cfg.lora.enable:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"# lora: rank {cfg.lora.rank}, {trainable} trainable adapter parameters")
    for line in describe_ranks(cfg, args, layout, activations=cfg.job.estimate_activations):
        print(f"# {line}")
    if cfg.job.estimate_step_time:
        from titan_kimi.parallel.step_time.describe import describe_step_time

        vision = model.vision_args if isinstance(model, KimiK3VLModel) else None
        for line in describe_step_time(cfg, args, layout, vision):
            print(f"# {line}")
    vision = f" vision={counts.total - text.total}" if isinstance(model, KimiK3VLModel) else ""
    print(f"params total={counts.total} active={text.active}{vision}")


class Trainer:
    def __init__(self, cfg, args, layout: ParallelLayout, env: DistEnv) -> None:
        self.cfg, self.args, self.layout, self.env = cfg, args, layout, env
        self.device = pick_device(env)
        init_distributed(env, self.device)
        seed_everything(cfg.job.seed, cfg.job.deterministic)
        self.dump = Path(cfg.job.dump_folder)
        t = cfg.training
        self.distributed = env.launched and env.world_size > 1
        # Every mesh comes from torchtitan's ParallelDims; the batch mesh says which data this rank reads.
        self.meshes: Meshes | None = build_meshes(layout, self.device.type) if self.distributed else None
        # The ranks of a CP group read the same batch; each keeps its share of every sequence (shard_batch), and
        # every forward gets this object as context_parallel= (its layers reach the rest of the rows through it).
        self.context_parallel = (ContextParallel(self.meshes.cp_group, layout.cp_layout) if layout.cp > 1
                                 else None)
        self.dp = layout.dp
        self.dp_rank = self.meshes.dp_rank if self.meshes is not None else 0
        self.global_batch, self.accum_steps = layout.global_batch_size, layout.accumulation_steps

        self.tokenizer = tokenizer_from_config(cfg, args)
        self.loss_fn = LinearCrossEntropyLoss(t.loss_chunk_size)
        whole = build_model_from_config(cfg, args, self.tokenizer)
        self.vision = whole.vision_args if isinstance(whole, KimiK3VLModel) else None
        self.counts = count_params(whole)
        # FLOPs per text token from the text model; the tower's are per image patch (vision_flops, per step).
        self.text_counts = count_params(whole, skip_prefixes=VISION_PREFIXES)
        self._flops_per_token: dict[int, float] = {}  # per batch length: the attention terms depend on it
        # padding tokens skip the routed experts: the step's FLOPs leave their share out
        self.routed_flops_per_token = routed_expert_flops_per_token(self.text_counts,
                                                                    frozen_backward=cfg.lora.enable)
        del whole
        # Before the model parts: a pipelined image-text model's first stage takes image slots sized by the data.
        self.dataloader = self._build_dataloader(cfg.data.path, seed=cfg.job.seed, shuffle=cfg.data.shuffle)
        self.validation_loader = self._build_validation_loader() if cfg.validation.enable else None
        self.model_parts, self.pipeline = self._build_model_parts()
        self.model = self.model_parts[0]  # the whole model unless pipelined
        self.named_params = [(n, p) for part in self.model_parts for n, p in part.named_parameters()
                             if p.requires_grad]
        self.optimizer = OptimizerParts([build_optimizer([part], cfg.optimizer) for part in self.model_parts])
        self.lr_scheduler = SchedulerParts([build_lr_scheduler(opt, cfg.lr_scheduler, t.steps)
                                            for opt in self.optimizer.optimizers])
        self.router_load = RouterLoad(self.model_parts, args)
        self.indexer_metrics = IndexerMetrics(self.model_parts, self.device) if args.indexer_trains else None
        self.replicated = ReplicatedGradients(self.model_parts, self.meshes.dense if self.meshes else None)
        # Every validation starts from the first batch, so runs that stop at validation.steps stay comparable.
        self.validation_start = self.validation_loader.state_dict() if self.validation_loader else None
        self.step = 0
        self.prewarm: FlaPrewarm | None = None  # main() hands over the ones it started
        self.module_prewarm: ModulePrewarm | None = None
        self.startup: StartupClock | None = None  # main() hands over its clock; train() logs it
        self.checkpointer = CheckpointManager.from_config(cfg.checkpoint, cfg.job.dump_folder)
        self.train_state = training_state(self.model_parts, self.optimizer.optimizers, self.lr_scheduler,
                                          self.dataloader)
        self._restore()
        self.metrics = MetricsLogger(
            self.dump, cfg.metrics.log_freq, cfg.metrics.save_jsonl, cfg.metrics.enable_tensorboard,
            cfg.metrics.progress, t.steps, is_main=env.is_main,
        )
        p = cfg.profiling
        self.profiler = StepProfiler(p.enable, p.steps, self.dump / p.folder, t.steps, env.rank, self.device)
        logger.info("%s | %s | params total=%d active=%d | global batch %d = %d ranks x %d x %d accumulation",
                    cfg.model.flavor, layout.describe(), self.counts.total, self.counts.active,
                    self.global_batch, self.dp, t.local_batch_size, self.accum_steps)

    # ------------------------------------------------------------------ setup
    def _build_model_parts(self):
        """This rank's model parts (the whole model, or its pipeline stages): built on the meta device,
        parallelised, then materialised and initialised with the seeded init (training/setup/seeded_init.py), which
        gives every parameter the values it has in one process, whatever the layout."""
        cfg, layout = self.cfg, self.layout
        plan = layout.pipeline
        pp_rank = self.meshes.pp_rank if self.meshes is not None else 0
        indices = plan.stages_of_rank(pp_rank) if plan is not None else [None]
        parts = [build_model_from_config(cfg, self.args, self.tokenizer,
                                         layer_range=plan.ranges[i] if plan is not None else None) for i in indices]
        self.autocast_dtype = None
        if self.distributed:
            from titan_kimi.parallel.parallelize import mixed_precision_dtype, parallelize

            sharded = [parallelize(part, cfg, self.meshes, self.device) for part in parts]
            if not all(sharded):  # no data-parallel mesh (pipeline parallelism alone): autocast instead
                self.autocast_dtype = mixed_precision_dtype(cfg)
        else:
            from titan_kimi.parallel.parallelize import apply_single_device

            self.autocast_dtype = apply_single_device(parts[0], cfg)
        for part in parts:
            part.to_empty(device=self.device)
            init_weights_seeded(part, cfg.job.seed)  # seeded per parameter, not per rank
            part.train()
        pipeline = self._build_pipeline(parts, indices) if plan is not None else None
        return parts, pipeline

    def _build_pipeline(self, parts: list[KimiK3Model], indices: list[int]):
        from titan_kimi.parallel.fsdp import reshard_after_forward, replicated_parameters, set_summed_gradients
        from titan_kimi.parallel.pipeline import PipelineRunner, PipelineStageModule, build_schedule

        cfg, layout = self.cfg, self.layout
        from torch.distributed.fsdp import fully_shard

        mixed = cfg.training.mixed_precision and cfg.model.dtype != cfg.training.param_dtype
        boundary = DTYPES[cfg.training.param_dtype] if mixed and self.autocast_dtype is None else \
            DTYPES[cfg.model.dtype]
        modules = []
        for index, part in zip(indices, parts):
            module = PipelineStageModule(part, self.loss_fn, boundary_dtype=boundary,
                                         autocast_dtype=self.autocast_dtype, context_parallel=self.context_parallel)
            if self.meshes.dense is not None:  # the stage wrapper is the FSDP root (pipelining's no-sync logic)
                fully_shard(module, mesh=self.meshes.dense, reshard_after_forward=False,
                            ignored_params=set(replicated_parameters(module)))
                set_summed_gradients(module, self.device.type != "cuda")
            modules.append((index, module))
        mb = layout.microbatch_size
        images = self._image_slots() if self.vision is not None else None  # None: text data, no images

        def build(length: int):  # length: this rank's tokens of each sequence
            return build_schedule(
                layout.pipeline, modules, device=self.device, group=self.meshes.pp_group,
                n_microbatches=cfg.training.local_batch_size // mb, microbatch=mb, seq_len=length,
                images=images, patch_size=self.vision.patch_size if self.vision is not None else 14,
                gradient_sync=cfg.parallelism.pipeline_gradient_sync,
                reshard_after_forward=reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward,
                                                            pipeline=True))

        return PipelineRunner(build, cfg.training.seq_len // layout.cp, [m for _, m in modules], images,
                              prefetch_weights=cfg.parallelism.pipeline_prefetch_weights)

    def _image_slots(self):
        """Per-sample image slots of a pipelined image-text run: the largest sample of its datasets."""
        from titan_kimi.parallel.pipeline_images import ImageSlots

        datasets = [loader.dataset for loader in (self.dataloader, self.validation_loader)
                    if loader is not None and hasattr(loader.dataset, "image_bounds")]
        return ImageSlots.for_datasets(self.vision.media_placeholder_token_id, datasets) if datasets else None

    def _build_dataloader(self, path: str, *, seed: int, shuffle: bool, infinite: bool = True, split: str = "train"):
        return dataloader_from_config(self.cfg, self.args, self.tokenizer, path, vision=self.vision, seed=seed,
                                      shuffle=shuffle, dp_rank=self.dp_rank, dp_world_size=self.dp,
                                      infinite=infinite, split=split)

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
            for part in self.model_parts:
                fmt = load_model_weights(part, cfg.initial_load_path, indexer_optional=self.cfg.model.add_indexer)
            logger.info("initial weights from %s (%s)%s", cfg.initial_load_path, fmt,
                        "; model.add_indexer: an indexer it lacks keeps its fresh initialisation"
                        if self.cfg.model.add_indexer else "")
        if restored is None and self.cfg.lora.adapter_path:  # a resumed run has its adapters in the checkpoint
            filled = load_adapters(self.model_parts, self.cfg.lora.adapter_path, group=self._pp_group())
            logger.info("LoRA adapters from %s (%d factors)", self.cfg.lora.adapter_path, len(filled))

    def _pp_group(self):
        """The pipeline group (adapters are spread over its stages), or None without pipelining."""
        return self.meshes.pp_group if self.pipeline is not None else None

    def _final_save(self) -> None:
        """The last step: the full training state, only the model (``last_save_model_only``), or an HF
        safetensors export in ``export_dtype`` (``last_save_in_hf``; with LoRA the adapters merged into their
        weights). A last step that is also due as an interval save is saved resumable as well, so that the run can
        be extended from it. With LoRA the adapters are written on their own first (``lora.save_adapters``)."""
        cfg, lora = self.cfg.checkpoint, self.cfg.lora
        if lora.enable and lora.save_adapters:
            path = save_adapters(self.model_parts, self.dump / "lora_adapters", targets=lora.target_modules,
                                 group=self._pp_group())
            logger.info("saved LoRA adapters to %s", path)
        if not cfg.enable:
            return
        if self.checkpointer.should_save(self.step) or not (cfg.last_save_model_only or cfg.last_save_in_hf):
            self.checkpointer.save(self.step, self.train_state, force=True)
        elif not cfg.last_save_in_hf:
            self.checkpointer.save(self.step, {"model": ModelState(self.model_parts)}, force=True)
        if cfg.last_save_in_hf:
            path = self.checkpointer.folder / f"hf-step-{self.step}"
            dtype = DTYPES[cfg.export_dtype]
            if self.pipeline is not None:  # each stage's first rank writes its shards, rank 0 the index
                export_hf_stages(self.model_parts, path, group=self._pp_group(), dtype=dtype, overwrite=True,
                                 tensors_of=merged_tensors if lora.enable else None)
            else:
                tensors = merged_tensors(self.model) if lora.enable else None
                export_hf_checkpoint(self.model, path, dtype=dtype, overwrite=True, tensors=tensors)
            logger.info("exported HF safetensors to %s%s", path, " (LoRA merged)" if lora.enable else "")

    # ------------------------------------------------------------------ one step
    def _forward_loss(self, batch: dict, normalizer: torch.Tensor, max_causal_keys: int | None,
                      indexer: dict | None = None) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
               else torch.autocast(self.device.type, enabled=False))
        images = {k: batch[k] for k in ("pixel_values", "grid_thws") if k in batch}
        with ctx:
            hidden = self.model(batch["input_ids"], doc_ids=batch["doc_ids"], return_hidden=True,
                                max_causal_keys=max_causal_keys, context_parallel=self.context_parallel, **images,
                                **(indexer or {}))
            return self.loss_fn(self.model.output, hidden, batch["labels"], normalizer)

    def _local(self, batch: dict) -> dict:
        """This rank's share of a batch: under context parallelism its tokens and labels of every sequence (the
        model gets the whole sequences' doc_ids); otherwise the batch itself."""
        return self.context_parallel.shard_batch(batch) if self.context_parallel is not None else batch

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per text token of a batch ``seq_len`` long (cached: a trimmed batch's length varies)."""
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(
                self.args, seq_len, self.text_counts, frozen_backward=self.cfg.lora.enable)
        return self._flops_per_token[seq_len]

    def _step_totals(self, host: list[dict]) -> StepTotals:
        """This step's sums over every rank of what its host batches hold, in one host collective before the
        forward (no device copy, no wait for the device): the tokens with a label over every micro-batch of
        every data-parallel rank, the images and the tower's FLOPs (`_image_work`), the tokens the model runs
        (padding included; fewer than global batch x seq_len where trailing padding is trimmed) and the model's
        FLOPs on them. Each CP rank counts its own share of the sequences, so the world sum counts every token
        once per pipeline rank (the ranks of one pipeline read the same batch); the count is exact, then divided
        by the pipeline degree. The padding is counted on the whole rows' doc ids, which every CP rank holds."""
        pp, cp = self.layout.pp, self.layout.cp
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in host)
        padding = sum(int((b["doc_ids"] == 0).sum()) for b in host)
        # whole rows (doc_ids stay whole under CP): each CP rank adds its 1/cp share
        run = sum(b["doc_ids"].numel() for b in host) / cp
        text_flops = sum(b["doc_ids"].numel() * self.flops_per_token(b["doc_ids"].shape[1]) for b in host) / cp
        images, image_flops = self._image_work(host)
        valid, images, image_flops, padding, run, text_flops = host_all_reduce(
            [float(local), float(images), image_flops, float(padding), run, text_flops])
        # padding tokens skip the routed experts: their share is left out
        flops = (text_flops - padding / cp * self.routed_flops_per_token) / pp + image_flops
        return StepTotals(valid / pp, int(images), flops, round(run / pp))

    def _micro_step(self, batch: dict, normalizer: torch.Tensor | float, *, backward: bool,
                    max_causal_keys: int | None = None, indexer: dict | None = None) -> torch.Tensor:
        """Forward (and backward) of one local batch; returns this rank's share of the normalised loss.
        ``max_causal_keys``: the host batch's longest document (the DSA dense shortcut); pipeline stages build
        their sequences themselves and decide from the row length alone. ``indexer``: the model's indexer
        arguments while it trains (`indexer_step_inputs`)."""
        if self.pipeline is not None:
            return self.pipeline.step(batch, float(normalizer), backward=backward, extra=indexer)
        loss = self._forward_loss(batch, normalizer, max_causal_keys, indexer)
        if backward:
            loss.backward()
        return loss.detach()

    def _indexer_inputs(self, host: list[dict], *, measure: bool) -> dict | None:
        """The model's indexer arguments for a step of this rank's host micro-batches while the indexer trains
        (``measure``: the recall too, on logging steps); None otherwise."""
        if self.indexer_metrics is None:
            return None
        return indexer_step_inputs(host, self.cfg, len(self.args.full_attn_layers), pp=self.layout.pp,
                                   cp=self.layout.cp, device=self.device, measure=measure,
                                   as_float=self.pipeline is not None)

    def train_step(self, data_iter) -> StepMetrics:
        """One optimizer step. The host reads the device once, after the backward: the gradient norm (which
        decides skip or stop), the loss and the router load together (`clip_gradients`' ``read_with``)."""
        cfg, t0 = self.cfg, time.perf_counter()
        multiple = cfg.training.pad_to_multiple_of
        host = [self._local(trim_padding(next(data_iter), multiple)) for _ in range(self.accum_steps)]
        # The loss of every micro-batch on every rank is divided by the step's global count of valid tokens.
        totals = self._step_totals(host)
        valid, images = totals.valid, totals.images
        # a fill kernel for the device's normaliser and asynchronous copies of the batches: a blocking
        # host-to-device copy would wait for the previous step's queued work
        global_valid = valid if self.pipeline is not None else torch.full(
            (), valid, dtype=torch.float32, device=self.device)
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in host]
        longest = [longest_document(b["doc_ids"]) for b in host]  # whole rows' doc_ids, also under CP
        logged = self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps
        indexer = self._indexer_inputs(host, measure=logged)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch, keys in zip(batches, longest):
            loss_sum += self._micro_step(batch, global_valid, backward=True, max_causal_keys=keys, indexer=indexer)
        self.replicated.sync()
        # ranks without the last pipeline stage add 0; each CP rank adds its share of the sequences
        loss = all_reduce_sum(loss_sum)
        load = self.router_load.reduce_and_reset()
        clip = clip_gradients(self.named_params, cfg.training.max_norm,
                              self.meshes.pp_group if self.meshes is not None else None,
                              read_with=(loss,) if load is None else (loss, load))
        loss_value, *load_values = clip.read_with
        load = load_of(load_values) if load_values else None
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
        reading = self.indexer_metrics.read_and_reset() if self.indexer_metrics is not None and logged else None
        # No device sync: the optimizer step stays queued and the next step's read of the norm waits for it, so
        # in a running loop each step's interval holds one step of device work.
        dt = time.perf_counter() - t0
        tokens = totals.tokens  # processed tokens, padding included (the trimmed length where it is cut)
        per_device = tokens / dt / self.layout.world_size
        flops = totals.flops
        return StepMetrics(
            step=self.step, loss=loss_value, grad_norm=clip.grad_norm, lr=lr, tokens=tokens, step_time=dt,
            tokens_per_sec=tokens / dt, tokens_per_sec_per_device=per_device,
            mfu=flops / dt / self.layout.world_size / cfg.metrics.peak_flops,
            peak_mem_gib=peak_memory_gib(self.device), skipped=skipped,
            expert_load_max=load.max if load else None, expert_load_min=load.min if load else None,
            images=images, images_per_sec=images / dt,
            indexer_kl=reading.kl if reading else None, indexer_recall=reading.recall if reading else None,
        )

    def _image_work(self, batches: list[dict]) -> tuple[int, float]:
        """Images in this rank's host batches, and the tower's and projector's FLOPs on them (`_step_totals`
        sums them over the ranks)."""
        if self.vision is None:
            return 0, 0.0
        # Under pipelining only the ranks of the first stage (the tower's) count, so each image counts once.
        model = next((part for part in self.model_parts if part.vision_tower is not None), None)
        grids = [tuple(g) for b in batches for g in b["grid_thws"].tolist()] if model is not None else []
        trains = lambda module: module is not None and any(p.requires_grad for p in module.parameters())
        local = vision_flops(self.vision, self.args.dim, grids, tower_trained=trains(model.vision_tower),
                             projector_trained=trains(model.mm_projector)) if model is not None else 0.0
        return len(grids), float(local)

    @torch.no_grad()
    def validate(self) -> None:
        cfg = self.cfg
        self.validation_loader.load_state_dict(self.validation_start)
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        one = torch.ones((), device=self.device)
        for i, batch in enumerate(self.validation_loader):
            if cfg.validation.steps != -1 and i >= cfg.validation.steps:
                break
            batch = self._local(trim_padding(batch, cfg.training.pad_to_multiple_of))
            count += int((batch["labels"] != IGNORE_INDEX).sum())
            keys = longest_document(batch["doc_ids"])
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += self._micro_step(batch, one, backward=False, max_causal_keys=keys)
        total = all_reduce_sum(total)
        count = float(all_reduce_sum(torch.tensor(float(count), device=self.device))) / self.layout.pp
        for part in self.model_parts:
            part.train()
        self.router_load.read_and_reset()  # validation routing is not training load
        self.metrics.log_validation(self.step, float(total) / max(count, 1.0), int(count))

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        cfg = self.cfg
        gc.disable()
        data_iter = iter(self.dataloader)
        stop = StopRequest().install()  # SIGTERM/SIGINT: finish the step, save, exit 128 + signal
        if self.module_prewarm is not None and self.module_prewarm.processes:
            self.module_prewarm.wait(timeout_s=600)  # their graphs are in Inductor's cache before the first step
            if self.startup is not None:
                self.startup.mark("waiting for compile.prewarm_modules")
        if self.startup is not None and (line := self.startup.line()) is not None:
            logger.info(line)
        compiles = CompileReport()
        try:
            while self.step < cfg.training.steps:
                self.step += 1
                with self.profiler.around(self.step) as profiled:
                    metrics = self.train_step(data_iter)
                self.metrics.log(metrics)
                if (line := compiles.line(self.step, metrics.step_time)) is not None:
                    logger.info(line)
                if self.prewarm is not None:
                    self.prewarm.finish(stop=False)
                if profiled:  # every rank profiled this step: all of them gather
                    self.metrics.log_profiles(self.step, gather_profiles(profiled[0]))
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
            compiles.close()
            stop.restore()
            gc.enable()
        logger.info(self.metrics.summary())

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


def main(argv: list[str] | None = None, prewarm: FlaPrewarm | None = None) -> int:
    """The trainer on ``argv`` (the command line's by default); ``prewarm``: FLA prewarm processes spawned before
    the imports (titan_kimi/train.py), which get this run's shape, or are sent away, here."""
    startup = StartupClock()
    startup.mark("imports")  # torch, torchtitan and this package, before main runs
    prewarm = FlaPrewarm() if prewarm is None else prewarm
    modules = ModulePrewarm()
    try:
        return _run(sys.argv[1:] if argv is None else argv, prewarm, modules, startup)
    finally:  # reap the prewarm processes (the module ones are running still only if the run failed early)
        prewarm.finish(stop=True)
        modules.wait(timeout_s=0)


def _run(argv: list[str], prewarm: FlaPrewarm, modules: ModulePrewarm, startup: StartupClock) -> int:
    cfg = load_job_config(argv)
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)
    if cfg.compile.cache_dir and not cfg.job.dry_run:  # before anything compiles or a prewarm process compiles
        logger.info("compile.cache_dir: %s", ", ".join(f"{k}={v}" for k, v in
                                                      use_compile_cache_dir(cfg.compile.cache_dir).items()))
    args = model_args_from_config(cfg)
    world_size = cfg.job.world_size or env.world_size
    if not cfg.job.world_size and "WORLD_SIZE" not in os.environ:
        validate_job_config(cfg, launcher_world_size=world_size)  # a plain process: check against 1 rank
    image_text = vision_args_from_config(cfg, tokenizer_from_config(cfg, args)) is not None
    layout = resolve_layout(cfg, world_size, args, image_text=image_text)
    if cfg.job.print_config and env.is_main and not cfg.job.dry_run:
        print(to_toml(cfg))
    if cfg.job.dry_run:
        if env.is_main:
            dry_run(cfg, args, layout)
        return 0
    if world_size != env.world_size:
        raise ValueError(f"job.world_size = {world_size} but the launcher started {env.world_size} processes")
    resolved = configure_kernels(cfg.kernels, args)
    check_routed_expert_gemm(cfg.training.routed_expert_gemm, pick_device(env))
    logger.info("kernels: %s", describe_kernels(resolved))
    if cfg.compile.prewarm_modules:
        if (reason := prewarm_unsupported(cfg, layout, image_text=image_text)) is not None:
            raise ValueError(f"compile.prewarm_modules = true {reason}")
        modules.start(args, cfg, argv)
    # before the model is built, so its compiles overlap the build and Dynamo's; a KDA layer's module prewarm runs
    # the op at this shape itself
    prewarm.start(args, cfg, pick_device(env), kda_backend=resolved["kda"], context_parallel=layout.cp,
                  local_rank=env.local_rank, wanted=not modules.processes)
    startup.mark("config, kernels and prewarm launch")
    trainer = Trainer(cfg, args, layout, env)
    trainer.prewarm, trainer.module_prewarm, trainer.startup = prewarm, modules, startup
    startup.mark("distributed set-up, model, data and optimizer")
    try:
        if resolved["kda"] == "fla":  # after Trainer set the device; before the first step imports fla
            from lowerings.kernels.fla_kda import prepare_fla_configs  # kernels.fla_configs

            logger.info(prepare_fla_configs())
        import_backend_libraries(resolved)
        startup.mark("backend libraries")
        trainer.train()
    finally:
        trainer.close()
        destroy()
    return 0

