"""DCP save/resume for training: ``<dump_folder>/<folder>/step-N/``, atomic, pruned, optionally asynchronous.

A save writes ``step-N.tmp/`` and renames it to ``step-N/`` only once every rank's data, the metadata and the
model args (``model_args.json``) are written; only then are older steps pruned. A crash mid-save leaves the
previous steps untouched and a ``.tmp`` folder that loading ignores and the next save deletes. A save is
never skipped: a step folder already on disk (incomplete, model-only, or from an older run) is replaced
atomically. Loading checks the saved model args and keys against the model, and resumes from the newest step
that holds everything asked for (a model-only final save is not resumable). Steps newer than the one a run
resumed from belong to the timeline it left: its first save moves them aside (``step-N.superseded-<time>``,
never deleted) so that no later resume picks them up. Works without a process group (one CPU process) and
under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import shutil
import time
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
from torch.distributed.checkpoint.metadata import Metadata

from titan_kimi.checkpoint.dcp_states import ModelState, OptimizerState, RankLocal, RNGState, global_rank
from titan_kimi.checkpoint.finite import check_finite_parameters
from titan_kimi.checkpoint.integrity import damaged_files, unreadable_data
from titan_kimi.checkpoint.model_identity import (check_model_args, check_same_indexer_training, check_saved_keys,
                                                  read_model_args, write_model_args, write_vision_args)
from titan_kimi.checkpoint.storage_errors import describe_write_failure
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.state_dict_adapter import is_adapter_key
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs

logger = logging.getLogger("titan_kimi")

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_SUFFIX = ".tmp"
_REPLACED_SUFFIX = ".replaced"  # a step folder being replaced by a new save of the same step
_METADATA = ".metadata"
_REMEDY = ("Resume with the model the checkpoint was saved from (model.flavor / model.hf_config_path), or point "
           "checkpoint.folder (or job.dump_folder) elsewhere to start a new run.")


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


def _model_args(state: dict[str, Any]) -> KimiK3ModelArgs | None:
    """The args of the Kimi model in a prepared state (stages carry the full model's args)."""
    for value in state.values():
        if isinstance(value, ModelState):
            args = getattr(value.parts[0], "args", None)
            if isinstance(args, KimiK3ModelArgs):
                return args
    return None


def _vision_args(state: dict[str, Any]) -> KimiK3VisionArgs | None:
    """The tower args of an image-text model in a prepared state (every stage carries them)."""
    for value in state.values():
        if isinstance(value, ModelState):
            return getattr(value.parts[0], "vision_args", None)
    return None


def _check_rank_entry(name: str, saved_keys: Any, path: Path) -> None:
    """Per-rank entries (data position, RNG) exist for the ranks that saved them only."""
    rank = global_rank()
    ranks = sorted({int(m.group(1)) for k in saved_keys if (m := re.match(rf"{re.escape(name)}\.rank_(\d+)\.", k))})
    if rank not in ranks:
        raise ValueError(
            f"checkpoint {path} holds the per-rank {name!r} state of ranks {ranks}, not of rank {rank}: it was saved "
            f"by {len(ranks)} rank(s); resume it with the same number of data-parallel ranks (or start a new run "
            f"from its weights with checkpoint.initial_load_path = {str(path)!r})"
        )


def _entries(saved_keys: Any) -> set[str]:
    """Top-level entries (model, optimizer, dataloader, ...) of a step's flattened DCP keys."""
    return {key.split(".", 1)[0] for key in saved_keys}


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
        self._pending: tuple[int, Future, KimiK3ModelArgs | None, KimiK3VisionArgs | None] | None = None
        self._resumed_from: int | None = None  # the step a load restored; newer steps are superseded on save
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
        state = _prepare_state(state)
        args, vision = _model_args(state), _vision_args(state)
        tmp = self.folder / f"step-{step}{_TMP_SUFFIX}"
        if global_rank() == 0:
            self._recover()
            self._supersede_newer_steps()
            tmp.mkdir(parents=True)
        self._resumed_from = None
        self._barrier()
        if self.async_mode == "disabled":
            try:
                with quiet_single_process():
                    dcp.save(state, checkpoint_id=str(tmp))
            except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
                raise RuntimeError(self._failed(step, "save", err)) from None
            self._finalize(step, args, vision)
            return True
        with quiet_single_process():
            response = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self._cpu_group, async_stager=self._async_stager()
            )
        upload = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state is copied: training may change it again
        self._pending = (step, upload, args, vision)
        return True

    def wait(self) -> None:
        """Finish an in-flight async save: wait for it, then rename and prune. Raises if it failed."""
        if self._pending is None:
            return
        step, future, args, vision = self._pending
        self._pending = None
        try:
            with quiet_single_process():
                future.result()
        except (Exception, CheckpointException) as err:
            raise RuntimeError(self._failed(step, "async save", err)) from None
        self._finalize(step, args, vision)

    def _failed(self, step: int, what: str, err: BaseException) -> str:
        return (
            f"checkpoint {what} of step {step} failed; the previous checkpoints {self.steps()} are intact and "
            f"{self.folder / f'step-{step}{_TMP_SUFFIX}'} will be removed by the next save. Cause:\n"
            f"{describe_write_failure(err, self.folder)}"
        )

    def _finalize(self, step: int, args: KimiK3ModelArgs | None, vision: KimiK3VisionArgs | None) -> None:
        if global_rank() == 0:
            tmp, final = self.folder / f"step-{step}{_TMP_SUFFIX}", self.step_dir(step)
            try:
                if args is not None:
                    write_model_args(tmp, args)
                if vision is not None:  # dcp-to-hf builds the tower from it
                    write_vision_args(tmp, vision)
            except OSError as err:
                raise RuntimeError(self._failed(step, "save", err)) from None
            if final.exists():  # incomplete, model-only or superseded: replaced, never skipped
                aside = self.folder / f"step-{step}{_REPLACED_SUFFIX}"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                os.replace(tmp, final)  # the commit point
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(tmp, final)  # the commit point
            self._prune()
        self._barrier()

    def _prune(self) -> None:
        if self.keep_latest_k == 0:
            return
        for old in self.steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def _recover(self) -> None:
        """Rank 0: delete the ``.tmp`` folders of interrupted saves; put back a step whose replacement was
        interrupted between its two renames (the new save never committed)."""
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if not (entry.is_dir() and entry.name.startswith("step-")):
                continue
            if entry.name.endswith(_TMP_SUFFIX):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.endswith(_REPLACED_SUFFIX):
                original = self.folder / entry.name[: -len(_REPLACED_SUFFIX)]
                if not original.exists() and (entry / _METADATA).is_file():
                    os.replace(entry, original)
                else:
                    shutil.rmtree(entry, ignore_errors=True)

    def _supersede_newer_steps(self) -> None:
        """Rank 0, at the first save after resuming from step S: steps newer than S are another timeline."""
        if self._resumed_from is None:
            return
        newer = [s for s in self.steps() if s > self._resumed_from]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for s in newer:
            os.replace(self.step_dir(s), self.folder / f"step-{s}.superseded-{stamp}")
        if newer:
            logger.warning("checkpoint: steps %s are newer than step %d this run resumed from; moved aside as "
                           "step-N.superseded-%s (not deleted) so no later resume loads them", newer,
                           self._resumed_from, stamp)

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
        """Restore ``state`` in place from ``step`` (default ``load_step``; -1 = the latest step that holds
        every entry of ``state``).

        Returns the step loaded, or None when checkpointing is disabled or there is nothing to resume from
        (with ``step=-1``). Only the entries named in ``state`` are read (e.g. ``{"model": model}`` alone).
        The saved model args and keys must match the model's; a ValueError names what differs.
        """
        if not self.enable:
            return None
        self.wait()
        if global_rank() == 0:
            self._recover()
        self._barrier()
        step = self.load_step if step is None else step
        state = _prepare_state(state)
        steps = self.steps()
        if step == -1:
            if not steps:
                return None
            step = self._latest_holding(steps, set(state))
        elif step not in steps:
            raise ValueError(f"no complete checkpoint step-{step} in {self.folder}; available steps: {steps}")
        path = self.step_dir(step)
        metadata = self._metadata(step, steps)
        saved = metadata.state_dict_metadata
        for name in [n for n, v in state.items() if isinstance(v, RNGState)]:
            if not any(k.startswith(f"{name}.rank_{global_rank()}.") for k in saved):
                # Saved by fewer ranks (another layout): this rank's streams restart from the run's seed.
                logger.warning("checkpoint %s holds no RNG state for rank %d (saved under another layout); "
                               "its random streams continue from the seed", path, global_rank())
                state = {k: v for k, v in state.items() if k != name}
        missing_entries = sorted(set(state) - _entries(saved))
        if missing_entries:
            raise ValueError(
                f"checkpoint {path} holds only {sorted(_entries(saved))}, not {missing_entries} (a model-only "
                f"save is not resumable); resumable steps: {self._resumable(steps, set(state))}. Pass "
                f"checkpoint.load_step = one of them, or start a new run from its weights with "
                f"checkpoint.initial_load_path = {str(path)!r} and another checkpoint.folder"
            )
        self._check_model(state, saved, path)
        damage = damaged_files(path, metadata, set(state))
        if damage:
            raise ValueError(f"checkpoint {path} is damaged: {'; '.join(d.describe() for d in damage)}. Nothing "
                             f"was loaded or moved. {self._intact_remedy(step, steps, set(state), metadata)}")
        optimizers = {name: v for name, v in state.items() if isinstance(v, OptimizerState)}
        for name, value in optimizers.items():
            value.restrict_to({k[len(name) + 1 :] for k in saved if k.startswith(name + ".")})
        try:
            with quiet_single_process():
                dcp.load(state, checkpoint_id=str(path))
        except (CheckpointException, RuntimeError, EOFError, pickle.UnpicklingError) as err:
            cause = unreadable_data(err)
            if cause is not None:
                raise ValueError(
                    f"checkpoint {path} is damaged: a data file of it cannot be read ({type(cause).__name__}: "
                    f"{str(cause).splitlines()[0]}). {self._intact_remedy(step, steps, set(state))}"
                ) from None
            if isinstance(err, CheckpointException):
                raise ValueError(f"loading checkpoint {path} failed (damaged or incomplete files?):\n{err}") from None
            raise
        finally:
            for value in optimizers.values():
                value.restrict_to(None)  # later saves write the full state
        for value in state.values():
            if isinstance(value, ModelState):
                for part in value.parts:
                    check_finite_parameters(part, f"checkpoint {path}")
        self._resumed_from = step if step != steps[-1] else None
        return step

    def _intact_remedy(self, step: int, steps: list[int], names: set[str],
                       metadata: Metadata | None = None) -> str:
        """What to do about a damaged ``step``: the newest other step that holds ``names`` with every file whole,
        and (given the ``metadata`` of a step whose damage is known file by file) whether its model weights are
        whole and can start a new run."""
        path = self.step_dir(step)
        intact = next((s for s in reversed(steps) if s != step and self._whole(s, steps, names)), None)
        if intact is not None:
            remedy = (f"The newest intact step is {self.step_dir(intact)}: resume from it with "
                      f"checkpoint.load_step = {intact} (its first save moves the newer steps aside, never deletes "
                      f"them)")
        else:
            remedy = f"No other step in {self.folder} is intact and resumable"
        if (metadata is not None and "model" in names and names != {"model"}
                and not damaged_files(path, metadata, {"model"})):
            remedy += (f"; the model weights of {path.name} are whole: checkpoint.initial_load_path = {str(path)!r} "
                       f"with another checkpoint.folder starts a new run from them")
        return remedy + "."

    def _whole(self, step: int, steps: list[int], names: set[str]) -> bool:
        """Whether ``step`` holds the entries ``names`` in files long enough for them."""
        try:
            metadata = self._metadata(step, steps)
        except ValueError:  # unreadable metadata
            return False
        holds = names <= _entries(metadata.state_dict_metadata)
        return holds and not damaged_files(self.step_dir(step), metadata, names)

    def _saved_keys(self, step: int, steps: list[int]) -> Any:
        return self._metadata(step, steps).state_dict_metadata

    def _metadata(self, step: int, steps: list[int]) -> Metadata:
        path = self.step_dir(step)
        try:
            return FileSystemReader(str(path)).read_metadata()
        except Exception as err:  # a damaged pickle raises anything from UnpicklingError to EOFError
            others = [s for s in steps if s != step]
            raise ValueError(
                f"checkpoint metadata {path / _METADATA} cannot be read ({type(err).__name__}: {err}); the step "
                f"is damaged. Move it away, or pass checkpoint.load_step = one of the other steps {others}"
            ) from None

    def _latest_holding(self, steps: list[int], names: set[str]) -> int:
        """The newest step holding every entry in ``names``; says so when it is not the newest step."""
        for step in reversed(steps):
            if names <= _entries(self._saved_keys(step, steps)):
                if step != steps[-1]:
                    logger.warning("checkpoint: resuming from step %d, the newest step holding %s; newer steps %s "
                                   "hold only part of it (model-only saves)", step, sorted(names),
                                   [s for s in steps if s > step])
                return step
        raise ValueError(
            f"no checkpoint in {self.folder} can be resumed: steps {steps} hold only the model (model-only "
            f"saves: checkpoint.last_save_model_only), and resuming needs {sorted(names)}. To continue from the "
            f"weights, pass checkpoint.initial_load_path = {str(self.step_dir(steps[-1]))!r} with another "
            f"checkpoint.folder"
        )

    def _resumable(self, steps: list[int], names: set[str]) -> list[int]:
        return [s for s in steps if names <= _entries(self._saved_keys(s, steps))]

    def _check_model(self, state: dict[str, Any], saved: Any, path: Path) -> None:
        """The saved model args and keys against the model being loaded into (named entries of ModelState)."""
        args = _model_args(state)
        for name, value in state.items():
            if isinstance(value, RankLocal):
                _check_rank_entry(name, saved, path)
            if not isinstance(value, ModelState):
                continue
            prefix = name + "."
            own = value.state_dict()
            if args is not None:
                saved_args = read_model_args(path)
                if saved_args is not None:
                    check_model_args(saved_args, args, f"checkpoint {path}", remedy=_REMEDY)
                    if any(isinstance(v, OptimizerState) for v in state.values()):
                        check_same_indexer_training(saved_args, args, path)
                # A LoRA model's adapters are not in the base model's keys; the missing-key check covers its own.
                lora = any(is_adapter_key(k) for k in own)
                check_saved_keys((k[len(prefix):] for k in saved
                                  if k.startswith(prefix) and not (lora and is_adapter_key(k[len(prefix):]))),
                                 args, f"checkpoint {path}", remedy=_REMEDY,
                                 vision=getattr(value.parts[0], "vision_args", None))
            missing = sorted(k for k in own if prefix + k not in saved)
            if missing:
                shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise ValueError(f"checkpoint {path} lacks {len(missing)} key(s) of this model: {shown}.\n{_REMEDY}")

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
