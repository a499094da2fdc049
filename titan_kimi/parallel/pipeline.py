"""Pipeline parallelism: this rank's stages (whole AttnRes blocks), their static I/O shapes, the schedule.

Stages pass ``(hidden [mb,S,H], bank [mb*S,m,H])`` positionally; tokens enter the first stage, and the last stage
applies the loss itself (summed CE over the step's global valid-token count, so ``scale_grads=False`` keeps
gradients equal to the non-pipelined run). ``doc_ids`` and ``labels`` are split into microbatches with the
inputs; the normaliser is a float, which the schedule hands unchanged to every microbatch. An image-text model's
first stage also takes the images, regrouped per sample (``pipeline_images.ImageSlots``) so that they split with
their samples, and packs each microbatch's images again before the tower.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_kimi.models.kimi_k3.model import KimiK3Model
from titan_kimi.models.kimi_k3.sequence import SequenceSharding
from titan_kimi.parallel.pipeline_images import ImageSlots, unpad_images
from titan_kimi.parallel.pipeline_plan import PipelinePlan

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, "torch.Tensor | float"], torch.Tensor]


class PipelineStageModule(nn.Module):
    """One stage as the schedule runs it (and the stage's FSDP root, so that pipelining's no-sync logic for
    microbatches applies). ``boundary_dtype`` is the dtype of what crosses to the next stage: the static
    shapes announce it, so outputs are cast to it (a no-op when the computation already has it).
    ``context_parallel``: this rank's share of every row under context parallelism, passed to each forward of
    the stage (``titan_kimi.parallel.context_parallel``)."""

    def __init__(self, part: KimiK3Model, loss_fn: LossFn, *, boundary_dtype: torch.dtype,
                 autocast_dtype: torch.dtype | None = None,
                 context_parallel: SequenceSharding | None = None) -> None:
        super().__init__()
        self.part = part
        self.context_parallel = context_parallel
        self.loss_fn = loss_fn
        self.boundary_dtype = boundary_dtype
        self.autocast_dtype = autocast_dtype

    def forward(self, *inputs: torch.Tensor, doc_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, normalizer: float | None = None, **indexer):
        device_type = inputs[0].device.type
        autocast = (torch.autocast(device_type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        with autocast:
            images = {}
            if self.part.is_first and len(inputs) == 3:  # tokens, per-sample pixel and grid slots
                inputs, (pixels, grids) = inputs[:1], inputs[1:]
                images = dict(zip(("pixel_values", "grid_thws"), unpad_images(pixels, grids)))
            # indexer: the model's indexer arguments while it trains (a float scale and a bool, replicated to
            # every microbatch); each stage's layers attach their KL to their own outputs
            if self.part.is_last:
                hidden = self.part(*inputs, doc_ids=doc_ids, return_hidden=True,
                                   context_parallel=self.context_parallel, **images, **indexer)
                return self.loss_fn(self.part.output, hidden, labels, normalizer)
            hidden, bank = self.part(*inputs, doc_ids=doc_ids, context_parallel=self.context_parallel, **images,
                                     **indexer)
        hidden, bank = hidden.to(self.boundary_dtype), bank.to(self.boundary_dtype)
        if bank._is_view():
            # FSDP hands a passed-through bank back as a view, which zero-bubble schedules cannot detach in place.
            bank = bank.clone()
        return hidden, bank


def stage_io_metas(part: KimiK3Model, microbatch: int, seq_len: int, dtype: torch.dtype,
                   images: ImageSlots | None = None, patch_size: int = 14):
    """Static shapes of a stage's inputs and outputs (meta tensors), so no shape-inference pass runs. With
    ``images`` the first stage also takes each sample's pixel and grid slots."""
    args = part.args
    dim, block = args.dim, args.attn_res_block_size

    def meta(*shape, dt=dtype, grad=False):
        return torch.empty(shape, dtype=dt, device="meta", requires_grad=grad)

    def bank_entries(layer: int) -> int:
        return layer // block if block else 0

    if part.is_first:
        inputs = (meta(microbatch, seq_len, dt=torch.int64),)
        if images is not None:
            inputs += (meta(microbatch, images.max_patches, 3, patch_size, patch_size, dt=torch.float32),
                       meta(microbatch, images.max_images, 3, dt=torch.int64))
    else:
        inputs = (meta(microbatch, seq_len, dim, grad=True),
                  meta(microbatch * seq_len, bank_entries(part.first_layer), dim, grad=True))
    if part.is_last:
        outputs = (meta(dt=torch.float32),)
    else:
        outputs = (meta(microbatch, seq_len, dim), meta(microbatch * seq_len, bank_entries(part.last_layer), dim))
    return inputs, outputs


def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@contextlib.contextmanager
def _gradient_sync_held(module: nn.Module, *, reshard_after_backward: bool):
    """FSDP reduce-scatters every unit's gradients in this backward and reshards as ``reshard_after_backward``
    says: torch's stage turns both off before every backward (its no-sync accumulation), so its two setters are
    shadowed on this module for the backward's duration."""
    module.set_requires_gradient_sync(True)
    module.set_reshard_after_backward(reshard_after_backward)
    names = ("set_requires_gradient_sync", "set_reshard_after_backward")
    for name in names:
        object.__setattr__(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in names:
            object.__delattr__(module, name)


def _microbatch_sync_stage_class():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class MicrobatchSyncStage(PipelineStage):
        """A stage whose FSDP units reduce-scatter their gradients in every microbatch's backward (each unit's
        post-backward hook, overlapped with the next unit's backward) instead of accumulating them unsharded
        until torch's REDUCE_GRAD after the last one. Gradients are summed either way (divide factor 1, the
        loss normalised by the step's valid tokens); REDUCE_GRAD then finds nothing left to reduce and
        reshards."""

        reshard_after_backward = False

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            if not isinstance(self.submod, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            with _gradient_sync_held(self.submod, reshard_after_backward=self.reshard_after_backward):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return MicrobatchSyncStage


def build_schedule(
    plan: PipelinePlan,
    stage_modules: Sequence[tuple[int, PipelineStageModule]],
    *,
    device: torch.device,
    group: dist.ProcessGroup,
    n_microbatches: int,
    microbatch: int,
    seq_len: int,
    images: ImageSlots | None = None,
    patch_size: int = 14,
    gradient_sync: str = "step",
    reshard_after_forward: bool = False,
):
    """The schedule over this rank's ``(stage index, module)`` pairs, with static stage shapes (``images``: the
    image-text model's per-sample image slots, ``patch_size`` its tower's). ``gradient_sync``: ``step`` (torch's
    no-sync accumulation, one reduce-scatter after the last backward) or ``microbatch`` (every backward
    reduce-scatters; the gathered weights are freed after each backward when ``reshard_after_forward``)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    if gradient_sync not in ("step", "microbatch"):
        raise ValueError(f"gradient_sync {gradient_sync!r}: valid step, microbatch")
    stage_class = PipelineStage
    if gradient_sync == "microbatch":
        stage_class = _microbatch_sync_stage_class()
    stages = []
    for index, module in stage_modules:
        inputs, outputs = stage_io_metas(module.part, microbatch, seq_len, module.boundary_dtype, images,
                                         patch_size)
        extra = {}
        # torch >= 2.12 takes the gradient metas too; without them static stages send zero input gradients.
        if _accepts(PipelineStage.__init__, "input_grads"):
            extra = dict(input_grads=(None,) * len(inputs) if module.part.is_first else inputs,
                         output_grads=None if module.part.is_last else outputs)
        stage = stage_class(module, index, plan.num_stages, device, input_args=inputs, output_args=outputs,
                            group=group, **extra)
        if gradient_sync == "microbatch":
            stage.reshard_after_backward = reshard_after_forward
        stages.append(stage)
    cls = get_schedule_class(plan.schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    # The last stage's module already returns the normalised loss: the schedule's loss function passes it on.
    return cls(stages[0] if single else stages, n_microbatches=n_microbatches,
               loss_fn=lambda output, target: output, scale_grads=False), stages


class PipelineRunner:
    """One optimizer micro-step of this rank's stages: fwd + bwd over the microbatches of a local batch.

    ``build(length)`` makes the schedule and stages for microbatches of ``length`` tokens per row (stages have
    static I/O shapes): the runner starts at ``length`` and, when a batch comes at another one (rows cut after
    their last real token, ``training.pad_to_multiple_of``), builds that length's schedule in place of the last
    one, whose receive buffers go with it. Every rank of a pipeline runs the same batch, so they switch together.

    ``prefetch_weights``: start every FSDP unit's all-gather when a step begins (asynchronously, in forward order)
    instead of in its first microbatch's forward, so that a later stage gathers while it waits for its first
    input. FSDP's pre-forward waits for them. From the second step on: the first forward initialises FSDP's
    root state (its streams), which the gathers need."""

    def __init__(self, build: Callable[[int], tuple], length: int, modules: Sequence[PipelineStageModule],
                 images: ImageSlots | None = None, *, prefetch_weights: bool = False) -> None:
        self._build, self.length = build, length
        self.schedule, self.stages = build(length)
        self.modules = list(modules)
        self.images = images
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.prefetch_weights = prefetch_weights
        self._steps = 0

    def _at_length(self, length: int) -> None:
        if length != self.length:
            self.schedule = self.stages = None  # the last length's buffers are free before the next are made
            self.schedule, self.stages = self._build(length)
            self.length = length

    def _prefetch(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules:
            for sub in module.modules():  # the root first, then its units in registration (forward) order
                if isinstance(sub, FSDPModule):
                    sub.unshard(async_op=True)

    def step(self, batch: dict[str, torch.Tensor], normalizer: float, *, backward: bool = True,
             extra: dict | None = None) -> torch.Tensor:
        """The sum of this rank's last-stage microbatch losses (zero on ranks without the last stage). ``extra``:
        further keyword arguments of every stage (non-tensors, which the schedule hands to each microbatch)."""
        if self.prefetch_weights and backward and self._steps:
            self._prefetch()
        self._steps += 1
        self._at_length(batch["labels"].shape[1])  # this rank's tokens of each row (doc_ids stay whole under CP)
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (batch["input_ids"],) if self.has_first else ()
        if self.has_first and self.images is not None:
            args += self.images.pad(batch["input_ids"], batch["pixel_values"], batch["grid_thws"])
        kwargs = dict(doc_ids=batch["doc_ids"], labels=batch["labels"], normalizer=normalizer, **(extra or {}))
        run = self.schedule.step if backward else self.schedule.eval
        # Outputs are scalar losses, which the schedule cannot merge into a batch: never ask for them.
        extra = {"return_outputs": False} if _accepts(self.schedule.step, "return_outputs") else {}
        run(*args, target=batch["labels"], losses=losses, **extra, **kwargs)
        device = batch["labels"].device
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()
