"""The ``parallelism`` degrees checked against each other, the batch and the world size: the part of the layout's
check that needs no model, so that ``validate_job_config`` runs it before anything is built.

``titan_kimi.parallel.layout.check_layout`` runs it too, between the routed-expert check and the checks against the
model (the pipeline's stages and microbatches, the KDA window under CP), and resolves the layout from it.
This module imports no torch (the CP chunk count comes from ``lowerings.ops.sequence_shards`` only under context
parallelism).
"""

from __future__ import annotations

from typing import Any, Callable

from titan_kimi.config.errors import ConfigError, bad_value, mention
from titan_kimi.config.sections import JobConfig

SourceOf = Callable[[str], "str | None"]
WORLD_KEYS = ("parallelism.data_parallel_replicate_degree", "parallelism.context_parallel_degree",
              "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree")


class LayoutCheck:
    """Renders one config key's value and source into a message (no source when none is known)."""

    def __init__(self, cfg: JobConfig, source_of: SourceOf | None) -> None:
        self.cfg, self.source_of = cfg, source_of

    def value(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(self.cfg, section), name)

    def source(self, key: str) -> str | None:
        return self.source_of(key) if self.source_of is not None else None

    def other(self, key: str) -> str:
        return mention(key, self.value(key), self.source(key))

    def reject(self, key: str, problem: str, valid: str) -> ConfigError:
        return bad_value(key, self.value(key), self.source(key), problem, valid)


def cp_chunks(cp_layout: str, cp: int) -> int:
    """How many chunks a sequence is cut into for ``cp`` context-parallel ranks under ``cp_layout``."""
    if cp == 1:
        return 1
    from lowerings.ops.sequence_shards import num_chunks  # imports torch: only under context parallelism

    return num_chunks(cp_layout, cp)


def check_degrees(cfg: JobConfig, world_size: int | None = None, *, image_text: bool = False,
                  source_of: SourceOf | None = None, world_source: str = "job.world_size") -> int:
    """The degrees and batch shapes; against the world size when given (``world_source`` says where it came from);
    ``image_text``: the model has a vision tower. Returns the data-parallel shard degree, resolved against the world
    size when given (else as configured, -1 for "the rest").

    Errors are ``ConfigError`` (a ValueError) naming the config key, its value, where it came from when
    ``source_of`` knows (``validate_job_config``'s sources), and what would be valid."""
    p, t = cfg.parallelism, cfg.training
    check = LayoutCheck(cfg, source_of)
    rep, cp, pp, ep = (p.data_parallel_replicate_degree, p.context_parallel_degree, p.pipeline_parallel_degree,
                       p.expert_parallel_degree)
    mb, local = p.pipeline_parallel_microbatch_size, t.local_batch_size
    # ---- the degrees and the batch, without the world size
    if pp > 1 and local % mb:
        raise check.reject("parallelism.pipeline_parallel_microbatch_size",
                           f"does not divide {check.other('training.local_batch_size')}", f"a divisor of {local}")
    if pp == 1 and p.pipeline_parallel_split:
        raise check.reject("parallelism.pipeline_parallel_split",
                           "needs pipeline_parallel_degree > 1 "
                           f"({check.other('parallelism.pipeline_parallel_degree')})",
                           "[] without pipeline parallelism")
    chunks = cp_chunks(p.context_parallel_layout, cp)
    if cp > 1 and t.seq_len % chunks:
        raise check.reject("training.seq_len",
                           f"cannot be cut into {chunks} equal chunks for "
                           f"{check.other('parallelism.context_parallel_degree')} with "
                           f"{check.other('parallelism.context_parallel_layout')}", f"a multiple of {chunks}")
    if cp > 1 and image_text:
        raise check.reject("parallelism.context_parallel_degree",
                           "with an image-text model: sharding sequences whose placeholders the model expands into "
                           "image positions is not built", "1 (the image-text recipes train without CP)")
    _check_expert_dispatch(check, ep, p.expert_parallel_dispatch, p.expert_parallel_node_size)
    _check_trimmed_rows(check, chunks, t.pad_to_multiple_of)
    shard = p.data_parallel_shard_degree
    if shard != -1:
        _experts_fit(check, shard, cp, ep)
    # ---- against the world size
    if world_size is None:
        return shard
    fixed = 1
    for key in WORLD_KEYS:
        fixed *= check.value(key)
    world = f"world size {world_size} ({world_source})"
    if world_size % fixed:
        degrees = ", ".join(check.other(key) for key in WORLD_KEYS)
        raise ConfigError(f"parallelism: {degrees} multiply to {fixed}, which does not divide {world}; "
                          f"valid: degrees whose product divides {world_size}",
                          key="parallelism", source=check.source(WORLD_KEYS[-1]), value=fixed)
    if shard != -1 and shard * fixed != world_size:
        raise check.reject("parallelism.data_parallel_shard_degree",
                           f"times the other degrees ({fixed}) is {shard * fixed}, not the {world}",
                           f"-1 or {world_size // fixed}")
    if shard == -1:
        shard = world_size // fixed
        _experts_fit(check, shard, cp, ep)
    if rep > 1 and shard * cp == 1:
        raise check.reject("parallelism.data_parallel_replicate_degree",
                           "with data_parallel_shard x context_parallel = 1: replication alone (DDP) is not "
                           "built", f"shard instead (data_parallel_shard_degree = {rep}, replicate 1), or HSDP "
                           "with data_parallel_shard_degree > 1")
    dp = rep * shard
    if t.global_batch_size != -1 and t.global_batch_size % (local * dp):
        raise check.reject("training.global_batch_size",
                           f"not a multiple of local_batch_size {local} * data-parallel degree {dp} "
                           f"(for the {world})", f"-1 or a multiple of {local * dp}")
    return shard


def _check_trimmed_rows(check: LayoutCheck, chunks: int, multiple: int) -> None:
    # The CP ranks cut each row into ``chunks`` equal chunks (1 without CP): every trimmed length (a multiple of
    # ``multiple``, or seq_len) must split so. (Pipeline stages take any length: PipelineRunner builds each
    # length's shapes.)
    if multiple and multiple % chunks:
        raise check.reject("training.pad_to_multiple_of",
                           f"cannot cut rows into {chunks} equal chunks for "
                           f"{check.other('parallelism.context_parallel_degree')} with "
                           f"{check.other('parallelism.context_parallel_layout')}: a trimmed row's length is a "
                           "multiple of it", f"0, or a multiple of {chunks}")


def _experts_fit(check: LayoutCheck, shard: int, cp: int, ep: int) -> None:
    # torchtitan 0.2.2 carves the EP mesh out of the FSDP ranks (data_parallel_shard * context_parallel).
    if (shard * cp) % ep:
        raise check.reject("parallelism.expert_parallel_degree",
                           f"does not divide data_parallel_shard_degree ({shard}) * context_parallel_degree ({cp}) "
                           f"= {shard * cp}, the ranks experts are spread over", f"a divisor of {shard * cp}")


NODE_GROUPS_VALID = ("2+ ranks per node and an EP degree of 2+ whole nodes (a multiple of the node size, at least "
                     "twice it)")


def _check_expert_dispatch(check: LayoutCheck, ep: int, dispatch: str, node_size: int) -> None:
    if dispatch != "hierarchical":
        if node_size:
            raise check.reject("parallelism.expert_parallel_node_size",
                               f"is never read with {check.other('parallelism.expert_parallel_dispatch')}",
                               "0, or expert_parallel_dispatch = hierarchical")
        return
    if ep == 1:
        raise check.reject("parallelism.expert_parallel_dispatch",
                           f"needs expert parallelism ({check.other('parallelism.expert_parallel_degree')})",
                           "flat, or expert_parallel_degree spanning 2+ nodes")
    problem = node_groups_problem(ep, node_size) if node_size else None
    if problem:
        raise check.reject("parallelism.expert_parallel_node_size", f"with expert_parallel_dispatch = hierarchical: "
                           f"{problem}", f"{NODE_GROUPS_VALID}, or the flat dispatch")


def planned_node_size(expert_parallel_node_size: int, gpus_per_node: int) -> int:
    """The ranks per node that the planning tools (the step-time estimate, its sweep, the rank-slice benchmark)
    give the hierarchical dispatch: ``parallelism.expert_parallel_node_size``, else ``step_time.gpus_per_node``
    (a launched job reads its launcher's ranks per node instead)."""
    return expert_parallel_node_size or gpus_per_node


def node_groups_problem(ep: int, node_size: int) -> str | None:
    """Why an EP group of ``ep`` consecutive ranks cannot take the hierarchical dispatch over nodes of
    ``node_size`` ranks (None when it can)."""
    if node_size < 2:
        return f"nodes of {node_size} rank(s) have nothing to fan out over"
    if ep % node_size or ep // node_size < 2:
        return f"expert_parallel_degree {ep} is not 2+ whole nodes of {node_size} ranks"
    return None
