"""Stateful wrappers that make a training run's state savable with torch.distributed.checkpoint (DCP).

Model and optimizer go through ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict`` so FQN-keyed,
DTensor-sharded (FSDP2, EP) state reshards on load. Per-rank state (RNG, data position) is keyed by rank,
because DCP keeps one copy of entries that have the same key on every rank.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger("titan_kimi")


def global_rank() -> int:
    """This process's rank in the default process group (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _parts(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


class ModelState(Stateful):
    """The model (or this rank's pipeline stages), as one FQN-keyed state dict."""

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        self.parts = _parts(model)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part) if k in state_dict}
            set_model_state_dict(part, own)  # strict: every key of the part must be present


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter FQN (flattened: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``),
    one optimizer per model part.

    What a load restores: the state (moments, step counts) from the checkpoint; the hyperparameters of every
    parameter group (lr, initial_lr, betas, eps, weight_decay, implementation flags) stay those of the optimizer
    loaded into, i.e. of this run's config, and the learning rate is the LR scheduler's to set. Copying the saved
    groups would run the first step after a resume at the saved run's lr whenever its schedule differs (an
    extended run: ``training.steps`` raised), whatever the scheduler restored, since DCP loads entries in sorted
    order (``lr_scheduler`` before ``optimizer``). Saved hyperparameters that differ (other than lr) are logged.

    Parameters that never had a gradient have no state (e.g. layer 0's AttnRes mix, which sees an empty bank);
    ``restrict_to`` (called by ``CheckpointManager.load`` with the saved keys) requests only saved state, and
    such parameters come back without state, exactly as they were saved.
    """

    _FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    ) -> None:
        self.parts = _parts(model)
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if len(self.optimizers) != len(self.parts):
            raise ValueError(
                f"OptimizerState needs one optimizer per model part; got {len(self.optimizers)} optimizers for "
                f"{len(self.parts)} parts"
            )
        self._saved_keys: set[str] | None = None

    def restrict_to(self, saved_keys: set[str] | None) -> None:
        """Before a load: the keys the checkpoint holds for this entry (None: no restriction, as for saving)."""
        self._saved_keys = None if saved_keys is None else set(saved_keys)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=self._FLAT))
        if self._saved_keys is None:
            return merged
        fqns = _group_fqns(merged)
        with_state = {_state_fqn(k, fqns) for k in self._saved_keys if k.startswith("state.")}
        # Group keys are read only to log changes, so a group key the checkpoint lacks (another optimizer class
        # saved it) is not requested. State keys that are neither saved nor stateless stay requested, so DCP names
        # them if they are missing.
        return {k: v for k, v in merged.items()
                if (k in self._saved_keys if k.startswith("param_groups.")
                    else not k.startswith("state.") or _state_fqn(k, fqns) in with_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            fqns = _group_fqns(state_dict)
            by_fqn: dict[str, dict[str, Any]] = {}
            for key, value in state_dict.items():
                if key.startswith("state."):
                    fqn = _state_fqn(key, fqns)
                    by_fqn.setdefault(fqn, {})[key.removeprefix(f"state.{fqn}.")] = value
            for part, opt in zip(self.parts, self.optimizers):
                # The optimizer's own nested layout gives the canonical FQNs and groups; fill it from the flat dict.
                nested = get_optimizer_state_dict(part, opt)
                owned = [fqn for group in nested["param_groups"] for fqn in group["params"]]
                state = {fqn: by_fqn[fqn] for fqn in owned if fqn in by_fqn}
                # The groups stay this run's (see the class docstring): the saved ones are only compared.
                _log_changed_hyperparameters(nested["param_groups"], state_dict)
                set_optimizer_state_dict(
                    part, opt, {"state": state, "param_groups": nested["param_groups"]},
                    options=StateDictOptions(strict=False),  # strict=False: stateless parameters stay stateless
                )
                _restore_state_dtypes(opt, nested["param_groups"], state)
        finally:
            self._saved_keys = None


def _log_changed_hyperparameters(groups: list[dict], saved: dict[str, Any]) -> None:
    """One log line naming the saved hyperparameters that differ from this run's (lr follows the schedule's
    position, so it is not compared)."""
    changed = {}
    for group in groups:
        for fqn in group["params"][:1]:
            for key, value in group.items():
                old = saved.get(f"param_groups.{fqn}.{key}", value)
                if key not in ("params", "lr") and _plain(old) != _plain(value):
                    changed[key] = (old, value)
    if changed:
        logger.info("optimizer: this run's hyperparameters replace the checkpoint's: %s",
                    ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items())))


def _plain(value: Any) -> Any:
    # A tuple (betas) may come back from the checkpoint as a list.
    return tuple(value) if isinstance(value, (list, tuple)) else value


class SchedulerState(Stateful):
    """A torch ``LRScheduler`` in a checkpoint: its own state, then its restored last lr set into its optimizer's
    groups (the optimizer's load leaves the groups' lr alone, see ``OptimizerState``). torch's schedulers resume
    their saved ``base_lrs`` and last lr; the trainer's ``SchedulerParts`` instead recomputes the lr from this
    run's schedule at the restored position."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


def _restore_state_dtypes(opt: torch.optim.Optimizer, fqn_groups: list[dict], state: dict[str, dict]) -> None:
    """torch's ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype, which
    would round fp32 moments of bf16 parameters (an optimizer with its own state dtype); put back the dtype
    the state was saved and loaded in."""
    for group, fqn_group in zip(opt.param_groups, fqn_groups):
        if len(group["params"]) != len(fqn_group["params"]):
            continue  # shared parameters: no one-to-one order to follow
        for param, fqn in zip(group["params"], fqn_group["params"]):
            for name, value in state.get(fqn, {}).items():
                current = opt.state[param].get(name)
                if torch.is_tensor(value) and torch.is_tensor(current) and current.dtype != value.dtype:
                    opt.state[param][name] = value.to(device=current.device)


def _group_fqns(flat: dict[str, Any]) -> set[str]:
    """Parameter FQNs of a flattened optimizer state dict (from its ``param_groups.<fqn>.<key>`` entries)."""
    return {k.removeprefix("param_groups.").rsplit(".", 1)[0] for k in flat if k.startswith("param_groups.")}


def _state_fqn(key: str, fqns: set[str]) -> str | None:
    """The parameter FQN of a flattened ``state.<fqn>.<name>`` key."""
    body = key.removeprefix("state.")
    while "." in body:
        body = body.rsplit(".", 1)[0]
        if body in fqns:
            return body
    return None


class RankLocal(Stateful):
    """Any ``state_dict``/``load_state_dict`` object whose state differs per rank (e.g. a rank-sharded loader)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{global_rank()}": self.obj.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict[f"rank_{global_rank()}"])


class RNGState(Stateful):
    """This rank's RNG streams: torch CPU, the current CUDA device (when CUDA is up), python ``random``, numpy."""

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {
                "bit_generator": np_state["bit_generator"],
                "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {f"rank_{global_rank()}": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[f"rank_{global_rank()}"]
        torch.set_rng_state(state["torch_cpu"])
        random.setstate(_as_python_rng_state(state["python"]))
        npst = state["numpy"]
        np.random.set_state({
            "bit_generator": npst["bit_generator"],
            "state": {"key": npst["key"].numpy().astype(np.uint32), "pos": int(npst["pos"])},
            "has_gauss": int(npst["has_gauss"]),
            "gauss": float(npst["gauss"]),
        })
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def _as_python_rng_state(value: Any) -> tuple:
    # random.setstate wants (version, tuple_of_ints, gauss_next) exactly as tuples.
    version, internal, gauss_next = value
    return int(version), tuple(int(x) for x in internal), gauss_next


def _scheduler_entry(scheduler: Any) -> Any:
    return SchedulerState(scheduler) if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) else scheduler


def training_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Stateful | None = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    *,
    rng: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """The state dict a training run saves and resumes: ``{"model", "optimizer", "lr_scheduler", "dataloader",
    "rng", **extra}`` (entries given as None are left out). Optimizers that already are FQN-keyed Stateful
    containers (torchtitan's) pass through; plain torch optimizers are wrapped in ``OptimizerState``."""
    state: dict[str, Any] = {"model": ModelState(model)}
    if optimizer is not None:
        plain = isinstance(optimizer, torch.optim.Optimizer) or (
            isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
        )
        state["optimizer"] = OptimizerState(model, optimizer) if plain else optimizer
    if isinstance(lr_scheduler, (list, tuple)):  # one per model part
        state.update({f"lr_scheduler_{i}": _scheduler_entry(s) for i, s in enumerate(lr_scheduler)})
    elif lr_scheduler is not None:
        state["lr_scheduler"] = _scheduler_entry(lr_scheduler)
    if dataloader is not None:
        # The loader's position is the same on every rank and independent of the layout (dataloader.py): one
        # entry, so that a run resumes under another data-parallel split.
        state["dataloader"] = dataloader
    if rng:
        state["rng"] = RNGState()
    state.update({k: v for k, v in extra.items() if v is not None})
    return state
