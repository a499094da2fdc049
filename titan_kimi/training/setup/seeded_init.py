"""Initial weights that do not depend on the parallel layout: every parameter is drawn from its own generator,
seeded by (job seed, parameter name, block), never by rank, so a layout reproduces any other.

A parameter is drawn in blocks of rows (dim 0): one expert per block for the stacked experts ``[E, ...]``, about
4M values per block for matrices, one block for vectors. A process draws only the blocks that overlap what it
owns (an FSDP2 shard on dim 0 or 1, an expert-parallel slice, a pipeline stage's layers) and copies its part, so
no process holds more than one block beyond its own shards. Values are drawn in fp32 on the parameter's device
and rounded to the parameter's dtype: the same seed gives the same weights on every layout of the same device
type (CPU and CUDA generators differ). Distributions come from the model's init_specs.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from titan_kimi.checkpoint.destinations import Destination, model_destinations
from titan_kimi.models.kimi_k3.init_specs import InitSpec, draw_, init_specs

BLOCK_VALUES = 1 << 22  # rows per block of a matrix: about this many values (16 MiB in fp32)


def parameter_seed(seed: int, fqn: str, block: int) -> int:
    """A 63-bit seed from (seed, name, block); stable across processes and Python runs (unlike hash())."""
    digest = hashlib.blake2b(f"{seed}\0{fqn}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rows_per_block(global_shape: tuple[int, ...]) -> int:
    """Rows of dim 0 drawn together; depends on the global shape only, never on the layout."""
    if len(global_shape) >= 3:
        return 1  # stacked experts: one expert per block, so an expert-parallel rank draws only its own
    if len(global_shape) == 2:
        return max(1, BLOCK_VALUES // max(1, global_shape[1]))
    return max(1, global_shape[0]) if global_shape else 1


def _draw(spec: InitSpec, shape: tuple[int, ...], row0: int, generator: torch.Generator,
          device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.float32, device=device)
    draw_(out, spec, generator, row0)
    return out


def _fill(dest: Destination, spec: InitSpec, seed: int) -> None:
    local = dest.local
    if local.numel() == 0:
        return
    if not spec.random:
        local.fill_(spec.value)
        return
    shape, offset = dest.global_shape, dest.offset
    if not shape:  # a scalar parameter: one draw
        gen = torch.Generator(device=local.device).manual_seed(parameter_seed(seed, dest.fqn, 0))
        local.copy_(_draw(spec, (), 0, gen, local.device))
        return
    per_block = rows_per_block(shape)
    first, last = offset[0], offset[0] + local.shape[0]  # the rows this process owns
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
    for block in range(first // per_block, math.ceil(last / per_block)):
        row0 = block * per_block
        rows = min(per_block, shape[0] - row0)
        gen = torch.Generator(device=local.device).manual_seed(parameter_seed(seed, dest.fqn, block))
        values = _draw(spec, (rows, *shape[1:]), row0, gen, local.device)
        lo, hi = max(first, row0), min(last, row0 + rows)
        local[lo - first : hi - first].copy_(values[(slice(lo - row0, hi - row0), *inner)])


@torch.no_grad()
def init_weights_seeded(model: nn.Module, seed: int, *, expert_range: tuple[int, int] | None = None) -> None:
    """Initialise ``model`` (materialised: ``to_empty`` first) in place from ``seed``.

    ``model`` may be the whole model, a pipeline stage (``KimiK3Model(args, layer_range=...)``: layers keep their
    global names), FSDP2/DTensor-sharded (any ``Shard(d)``/``Replicate`` placements), or hold plain expert slices
    ``expert_range=(first, last)``. Every parameter gets the values it has in a single-process model with the
    same seed.
    """
    specs = init_specs(model)
    for dest in model_destinations(model, expert_range=expert_range):
        if dest.fqn not in specs:
            raise ValueError(f"{dest.fqn} is in the state dict but is not a parameter with an initial distribution "
                             f"(a buffer?); initialise it explicitly")
        _fill(dest, specs[dest.fqn], seed)
