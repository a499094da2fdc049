"""Adam(W) with a moment dtype of its own, as multi-tensor (``torch._foreach_*``) kernels; math in fp32.

torch's Adam keeps the moments in each parameter's dtype, which cannot express fp32 weights with bf16 moments
(or the reverse). This one stores them in the parameter group's ``state_dtype`` and updates every parameter
of a bucket (same device, parameter, gradient and moment dtype) with one launch per operation: no Python loop
over parameters and no host-device sync. Step counts are CPU tensors per parameter (the layout torch's
non-fused Adam and checkpoints use); their values reach the kernels as Python scalar lists.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

# fp32 working copies are made per chunk of a bucket, so their memory stays bounded (~4 copies x 256 MiB)
# whatever the model size.
_CHUNK_NUMEL = 1 << 26


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under no_grad, DTensor.to_local() is the local shard itself, so in-place updates reach the DTensor.
    return t.to_local() if isinstance(t, DTensor) else t


def _fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 versions of ``tensors``: the tensors themselves when already fp32 (updated in place), else copies."""
    if tensors[0].dtype == torch.float32:
        return tensors
    out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def _chunks(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if chunks[-1] and size + p.numel() > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel()
    return chunks


class MultiTensorAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) or AdamW (``decoupled``), moments in each group's ``state_dtype``.

    Parameters may be DTensors (FSDP2 shards): the kernels run on their local shards."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 *, decoupled: bool, state_dtype: torch.dtype = torch.float32,
                 chunk_numel: int = _CHUNK_NUMEL) -> None:
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel = {chunk_numel}: must be >= 1")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=state_dtype)
        super().__init__(params, defaults)
        self.decoupled = decoupled
        self.chunk_numel = chunk_numel

    def _state(self, p: torch.Tensor, state_dtype: torch.dtype) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
        elif state["step"].device.type != "cpu":  # a checkpoint loaded it elsewhere: once, then it stays here
            state["step"] = state["step"].cpu()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts every floating state tensor to its parameter's dtype, which would round fp32
        moments of bf16 parameters: the moments are put back in the saved tensors' dtype. The step counts are
        copied: torch keeps the caller's tensors, which the in-place step would then advance too."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            if p not in self.state:  # (self.state is a defaultdict: a lookup would add an empty state)
                continue
            state = self.state[p]
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().cpu().clone()  # torch keeps the caller's; steps are in place
            for key, value in state_dict["state"].get(pid, {}).items():
                current = state.get(key)
                if key != "step" and torch.is_tensor(current) and current.dtype != value.dtype:
                    state[key] = value.to(device=current.device, copy=True)  # never the caller's tensor

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._state(p, group["state_dtype"])
                local = _local(p)
                key = (local.device, local.dtype, _local(p.grad).dtype)
                buckets.setdefault(key, []).append(p)
            for bucket in buckets.values():
                steps = [self.state[p]["step"] for p in bucket]
                torch._foreach_add_(steps, 1.0)
                counts = torch.stack(steps).tolist()  # CPU tensors: no device sync
                start = 0
                for chunk in _chunks(bucket, self.chunk_numel):
                    self._update(chunk, counts[start:start + len(chunk)], group)
                    start += len(chunk)
        return loss

    def _update(self, params: list[torch.Tensor], counts: list[float], group: dict) -> None:
        lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        weights = [_local(p) for p in params]
        exp_avgs = [_local(self.state[p]["exp_avg"]) for p in params]
        exp_avg_sqs = [_local(self.state[p]["exp_avg_sq"]) for p in params]
        w32 = _fp32(weights)
        g32 = _fp32([_local(p.grad) for p in params])
        if wd and not self.decoupled:
            g32 = torch._foreach_add(g32, w32, alpha=wd)  # a new list: the gradients stay as they are
        m32, v32 = _fp32(exp_avgs), _fp32(exp_avg_sqs)
        torch._foreach_lerp_(m32, g32, 1 - b1)
        torch._foreach_mul_(v32, b2)
        torch._foreach_addcmul_(v32, g32, g32, value=1 - b2)
        for stored, new in ((exp_avgs, m32), (exp_avg_sqs, v32)):
            if new is not stored:
                torch._foreach_copy_(stored, new)
        # The update uses the fp32 moments before they are rounded to state_dtype (as the reference does).
        denom = torch._foreach_div(v32, [1 - b2**t for t in counts])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        if wd and self.decoupled:
            torch._foreach_mul_(w32, 1 - lr * wd)
        torch._foreach_addcdiv_(w32, m32, denom, [-lr / (1 - b1**t) for t in counts])
        if w32 is not weights:
            torch._foreach_copy_(weights, w32)
