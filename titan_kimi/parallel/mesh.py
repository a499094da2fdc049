"""The device meshes of a layout, all built by torchtitan's ``ParallelDims`` (the one mesh authority).

Its meshes: ``pp``; ``batch`` (dp_replicate x dp_shard: which batch a rank reads); ``loss`` (batch x cp); the dense
parameters' ``dp_replicate`` x ``fsdp`` (fsdp = dp_shard x cp); the experts' ``dp_replicate`` x ``efsdp`` x ``ep``
(ep carved out of fsdp). Size-1 dims use torchtitan's fake backend, so they create no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_kimi.parallel.layout import ParallelLayout


def _use_device_type(device_type: str) -> None:
    # torchtitan picks "cuda" at import even without a GPU; its mesh building reads this module global.
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device_type


@dataclass
class Meshes:
    """The meshes one rank takes part in (None where the dim has size 1) and its data-parallel coordinates."""

    dims: object  # torchtitan.distributed.ParallelDims
    layout: ParallelLayout

    def optional(self, name: str | list[str]) -> DeviceMesh | None:
        return self.dims.get_optional_mesh(name)

    # ---------------------------------------------------------------- data
    @property
    def dp_rank(self) -> int:
        """This rank's position on the batch mesh: ranks of one pipeline (or CP group) read the same batch."""
        mesh = self.optional("batch")
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    # ---------------------------------------------------------------- pipeline
    @property
    def pp_rank(self) -> int:
        mesh = self.optional("pp")
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        mesh = self.optional("pp")
        return mesh.get_group() if mesh is not None else None

    # ---------------------------------------------------------------- context parallelism
    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split this rank's sequences (they read the same batch); None without CP."""
        mesh = self.optional("cp")
        return mesh.get_group() if mesh is not None else None

    # ---------------------------------------------------------------- parameters
    @property
    def dense(self) -> DeviceMesh | None:
        """FSDP mesh of the dense parameters (2-D for HSDP); None when they are not sharded or replicated."""
        if self.layout.dp_replicate > 1:
            return self.optional(["dp_replicate", "fsdp"])
        return self.optional("fsdp")

    @property
    def ep(self) -> DeviceMesh | None:
        return self.optional("ep")

    @property
    def experts(self) -> DeviceMesh | None:
        """FSDP mesh of the expert weights under expert parallelism (efsdp, with dp_replicate for HSDP)."""
        if self.layout.ep == 1:
            return None
        if self.layout.dp_replicate > 1:
            return self.optional(["dp_replicate", "efsdp"])
        return self.optional("efsdp")


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    """All meshes of ``layout`` for this process (the default process group must be initialised)."""
    _use_device_type(device_type)
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp, tp=1,
                        pp=layout.pp, ep=layout.ep, etp=1, world_size=layout.world_size)
    dims.build_mesh()
    return Meshes(dims, layout)
