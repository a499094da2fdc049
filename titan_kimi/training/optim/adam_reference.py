"""The per-parameter Adam(W) with its own moment dtype that titan_kimi used before the multi-tensor one.

Kept as the reference that tests and ``scripts/bench/optimizer_step.py`` compare
:class:`titan_kimi.training.optim.adam_multi_tensor.MultiTensorAdam` against: a Python loop over parameters, each
with its own fp32 copies and kernels. Not used in training.
"""

from __future__ import annotations

from typing import Iterable

import torch


class AdamWithStateDtype(torch.optim.Optimizer):
    """Adam(W) whose moments are stored in ``state_dtype`` whatever the parameter dtype; math in fp32.

    torch's own AdamW keeps the moments in the parameter's dtype, which cannot express fp32 weights with
    bf16 moments (or the reverse). Parameters may be DTensors (FSDP2 shards).
    """

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 *, decoupled: bool, state_dtype: torch.dtype = torch.float32) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=state_dtype)
        super().__init__(params, defaults)
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            state_dtype = group["state_dtype"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
                state["step"] += 1
                t = state["step"].item()
                grad = p.grad.float()
                weight = p.float()
                if wd and not self.decoupled:
                    grad = grad + wd * weight
                m = state["exp_avg"].float().lerp_(grad, 1 - b1)
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(grad, grad, value=1 - b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                denom = (v / (1 - b2**t)).sqrt_().add_(eps)
                update = (m / (1 - b1**t)) / denom
                if wd and self.decoupled:
                    weight.mul_(1 - lr * wd)
                p.copy_(weight - lr * update)
