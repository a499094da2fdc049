"""Building AdamW / Adam with a chosen dtype for the moments, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titan_kimi.dtypes import DTYPES
from titan_kimi.training.optim.adam_multi_tensor import MultiTensorAdam


def build_optimizer(model_parts: list[torch.nn.Module], cfg) -> torch.optim.Optimizer:
    """From the ``[optimizer]`` config section.

    Moments are kept in ``cfg.state_dtype``, except for the parameters the model keeps in fp32 by design
    (A_log, conv weights, ...), whose moments stay fp32. torch's fused/foreach Adam(W) runs when every moment
    can follow its parameter's dtype (fp32 weights and moments; bf16 weights and moments, the fp32-by-design
    parameters then in fp32 inside the same kernels, which group tensors by dtype); otherwise
    :class:`MultiTensorAdam` does.
    """
    from titan_kimi.models.kimi_k3.init import fp32_parameter_names

    named = [(n, p) for m in model_parts for n, p in m.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    keep_fp32 = set().union(*(fp32_parameter_names(m) for m in model_parts))
    state_dtype = DTYPES[cfg.state_dtype]
    moments_follow_params = all(n in keep_fp32 or p.dtype == state_dtype for n, p in named)
    params = [p for _, p in named]
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    decoupled = cfg.name == "AdamW"
    if not moments_follow_params and cfg.implementation != "auto":
        raise ValueError(
            f"optimizer.implementation = {cfg.implementation!r}: torch's Adam keeps the moments in the parameter "
            f"dtype, but optimizer.state_dtype = {cfg.state_dtype!r} differs from the parameters'; valid: 'auto' "
            f"(titan_kimi's Adam with its own moment dtype), or a state_dtype equal to the parameter dtype"
        )
    if not moments_follow_params:
        groups = [
            {"params": [p for n, p in named if n in keep_fp32], "state_dtype": torch.float32},
            {"params": [p for n, p in named if n not in keep_fp32], "state_dtype": state_dtype},
        ]
        return MultiTensorAdam([g for g in groups if g["params"]], decoupled=decoupled, **kwargs)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if params[0].device.type in ("cuda", "cpu") else "foreach"
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[impl]
    # Sharded (DTensor) and whole parameters (those FSDP leaves replicated) in separate groups: one fused or
    # foreach kernel cannot mix the two kinds of tensor.
    sharded = [p for p in params if isinstance(p, DTensor)]
    whole = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (sharded, whole) if g]
    return cls(groups, **kwargs, **flags)


class OptimizerParts:
    """One optimizer per model part (this rank's pipeline stages; one part without pipelining), stepped as one.

    Per part, so that each optimizer's state is keyed by its own module's parameter names (which checkpoints
    store, whatever the layout)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class SchedulerParts:
    """The LR schedule of every part's optimizer; they are identical, so one state is saved and loaded into all."""

    def __init__(self, schedulers: list[LambdaLR]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        # Only the position: the learning rates follow from it, and the number of parameter groups per optimizer
        # depends on the layout (sharded and whole parameters are grouped apart), so a resume under another
        # layout recomputes them.
        first = self.schedulers[0]
        return {"last_epoch": first.last_epoch, "step_count": first._step_count}

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = int(state["last_epoch"])
            scheduler._step_count = int(state.get("step_count", state.get("_step_count", 1)))
            lrs = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs


def lr_lambda(step: int, *, total: int, warmup: int, decay_ratio: float, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak lr at (0-based) ``step``: linear warmup, flat, then decay to ``min_lr_factor``."""
    if warmup and step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_type == "constant":
        return 1.0
    decay_steps = total - warmup if decay_ratio < 0 else round(total * decay_ratio)
    decay_start = total - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    shape = {
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        "sqrt": 1.0 - math.sqrt(progress),
    }[decay_type]
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> LambdaLR:
    """From the ``[lr_scheduler]`` config section; stepped once per optimizer step."""
    return LambdaLR(
        optimizer,
        lambda step: lr_lambda(step, total=total_steps, warmup=cfg.warmup_steps, decay_ratio=cfg.decay_ratio,
                               decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor),
    )
