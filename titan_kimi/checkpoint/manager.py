"""DCP save/resume for training: ``<dump_folder>/<folder>/step-N/``, atomic, pruned, optionally asynchronous.

A save writes ``step-N.tmp/`` and renames it to ``step-N/`` only once every rank's data and the metadata are
written; only then are older steps pruned. A crash mid-save leaves the previous steps untouched and a
``.tmp`` folder that loading ignores and the next save deletes. Works without a process group (one CPU
process) and under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from titan_kimi.checkpoint.dcp_states import ModelState, OptimizerState, RNGState, global_rank

logger = logging.getLogger("titan_kimi")

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_SUFFIX = ".tmp"
_METADATA = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# DCP warns on every save without a process group, also from the background thread of an async save; one
# process is an intended mode here, so that one message is silenced process-wide.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Keeps DCP's single-process warning quiet even where a caller reset the warning filters."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def _prepare_state(state: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(state, dict) or not state:
        raise ValueError("checkpoint state must be a non-empty dict of name -> Stateful object or dict")
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            raise ValueError(
                f"checkpoint state {name!r} is a bare torch optimizer, whose state is keyed by parameter position; "
                f"wrap it as OptimizerState(model, optimizer) (or use training_state(...)) so it is FQN-keyed"
            )
        out[name] = ModelState(value) if isinstance(value, nn.Module) else value
    return out


class CheckpointManager:
    """Save every ``interval`` steps (or when forced), keep the newest ``keep_latest_k`` (0 = all), resume from
    ``load_step`` (-1 = the latest complete step).

    ``state`` is a dict of Stateful objects (``state_dict``/``load_state_dict``) or plain dicts; see
    ``training_state`` for model + optimizer + LR scheduler + dataloader + RNG.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        enable: bool = True,
        interval: int = 500,
        keep_latest_k: int = 10,
        async_mode: str = "disabled",
        load_step: int = -1,
    ) -> None:
        if interval < 1:
            raise ValueError(f"checkpoint interval={interval} must be >= 1")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint keep_latest_k={keep_latest_k} must be >= 0 (0 keeps every checkpoint)")
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint async_mode={async_mode!r} is invalid; valid: {list(ASYNC_MODES)}")
        if load_step < -1:
            raise ValueError(f"checkpoint load_step={load_step} must be >= 0, or -1 for the latest")
        self.folder = Path(folder)
        self.enable, self.interval, self.keep_latest_k = enable, interval, keep_latest_k
        self.async_mode, self.load_step = async_mode, load_step
        self._pending: tuple[int, Future] | None = None
        self._stager = None
        # Background saves and barriers run on a CPU (gloo) group, as NCCL collectives cannot run off-stream.
        self._cpu_group = None
        if enable and _distributed() and dist.get_backend() != "gloo":
            self._cpu_group = dist.new_group(backend="gloo")

    @classmethod
    def from_config(cls, checkpoint: Any, dump_folder: str | Path) -> "CheckpointManager":
        """From the job config's ``[checkpoint]`` section and ``job.dump_folder``."""
        return cls(
            Path(dump_folder) / checkpoint.folder,
            enable=checkpoint.enable,
            interval=checkpoint.interval,
            keep_latest_k=checkpoint.keep_latest_k,
            async_mode=checkpoint.async_mode,
            load_step=checkpoint.load_step,
        )

    # ------------------------------------------------------------------ layout
    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def steps(self) -> list[int]:
        """Complete checkpoints on disk, oldest first (``.tmp`` folders of interrupted saves are ignored)."""
        if not self.folder.is_dir():
            return []
        found = []
        for entry in self.folder.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / _METADATA).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, *, force: bool = False) -> bool:
        return self.enable and (force or step % self.interval == 0)

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state`` as step ``step`` if it is due (every ``interval`` steps, or ``force``).

        Returns whether a save was made (or started, in async mode). A step already on disk is not re-saved.
        """
        if not self.should_save(step, force=force):
            return False
        self.wait()  # the previous async save must be complete (and renamed) before the next one
        if self.step_dir(step).exists():
            return False
        state = _prepare_state(state)
        tmp = self.folder / f"step-{step}{_TMP_SUFFIX}"
        if global_rank() == 0:
            self._remove_stale_tmp()
            tmp.mkdir(parents=True)
        self._barrier()
        if self.async_mode == "disabled":
            try:
                with quiet_single_process():
                    dcp.save(state, checkpoint_id=str(tmp))
            except CheckpointException as err:  # a BaseException in DCP: surface it as an ordinary error
                raise RuntimeError(self._failed(step, "save", err)) from None
            self._finalize(step)
            return True
        with quiet_single_process():
            response = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self._cpu_group, async_stager=self._async_stager()
            )
        upload = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state is copied: training may change it again
        self._pending = (step, upload)
        return True

    def wait(self) -> None:
        """Finish an in-flight async save: wait for it, then rename and prune. Raises if it failed."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            with quiet_single_process():
                future.result()
        except (Exception, CheckpointException) as err:
            raise RuntimeError(self._failed(step, "async save", err)) from None
        self._finalize(step)

    def _failed(self, step: int, what: str, err: BaseException) -> str:
        return (
            f"checkpoint {what} of step {step} failed; the previous checkpoints {self.steps()} are intact and "
            f"{self.folder / f'step-{step}{_TMP_SUFFIX}'} will be removed by the next save. Cause:\n{err}"
        )

    def _finalize(self, step: int) -> None:
        if global_rank() == 0:
            os.replace(self.folder / f"step-{step}{_TMP_SUFFIX}", self.step_dir(step))  # the commit point
            self._prune()
        self._barrier()

    def _prune(self) -> None:
        if self.keep_latest_k == 0:
            return
        for old in self.steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        if self.folder.is_dir():
            for entry in self.folder.iterdir():
                if entry.is_dir() and entry.name.startswith("step-") and entry.name.endswith(_TMP_SUFFIX):
                    shutil.rmtree(entry, ignore_errors=True)

    def _async_stager(self) -> Any:
        if self.async_mode != "async_with_pinned_mem":
            return None  # DCP's default stager: a synchronous CPU copy of the state
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(pinned, False, False, False))
        return self._stager

    # ------------------------------------------------------------------ load
    def load(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Restore ``state`` in place from ``step`` (default ``load_step``; -1 = the latest complete step).

        Returns the step loaded, or None when checkpointing is disabled or there is nothing to resume from
        (with ``step=-1``). Only the entries named in ``state`` are read (e.g. ``{"model": model}`` alone).
        """
        if not self.enable:
            return None
        self.wait()
        step = self.load_step if step is None else step
        steps = self.steps()
        if step == -1:
            if not steps:
                return None
            step = steps[-1]
        elif step not in steps:
            raise ValueError(f"no complete checkpoint step-{step} in {self.folder}; available steps: {steps}")
        state = _prepare_state(state)
        path = self.step_dir(step)
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name in [n for n, v in state.items() if isinstance(v, RNGState)]:
            if not any(k.startswith(f"{name}.rank_{global_rank()}.") for k in saved):
                # Saved by fewer ranks (another layout): this rank's streams restart from the run's seed.
                logger.warning("checkpoint %s holds no RNG state for rank %d (saved under another layout); "
                               "its random streams continue from the seed", path, global_rank())
                state = {k: v for k, v in state.items() if k != name}
        optimizers = {name: v for name, v in state.items() if isinstance(v, OptimizerState)}
        for name, value in optimizers.items():
            value.restrict_to({k[len(name) + 1 :] for k in saved if k.startswith(name + ".")})
        try:
            with quiet_single_process():
                dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as err:
            raise RuntimeError(f"loading checkpoint {path} failed:\n{err}") from None
        finally:
            for value in optimizers.values():
                value.restrict_to(None)  # later saves write the full state
        return step

    def close(self) -> None:
        """Finish any in-flight save and release staging buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self._cpu_group)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
