"""How many routed rows one expert-parallel rank receives for each of its local experts (and from which source
rank): balanced, a stated Zipf-like skew over the experts, or a measured per-expert load.

Every EP rank routes ``tokens x top_k`` rows; the ``num_experts / ep`` experts of a rank receive their share of
all ``ep`` ranks' rows. Balanced, each rank receives ``tokens x top_k`` rows, as many as it sends. Skewed, the
rank whose experts are the most popular receives more, and that rank sets the pace of every all-to-all and of
the MoE layer's compute: the skewed loads below are the busiest rank's.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ExpertLoad:
    """``counts [ep, local]``: rows from source EP rank ``s`` for local expert ``e``, torchtitan's layout after
    the dispatch all-to-all (``num_tokens_per_expert_group``)."""

    counts: torch.Tensor
    name: str  # balanced | zipf:<exponent> | measured
    rank_factor: float  # rows this rank receives / the balanced share (1.0 balanced)
    expert_factor: float  # most rows of one of its experts / the balanced share of one expert

    @property
    def rows(self) -> int:
        return int(self.counts.sum())

    def describe(self) -> str:
        return (f"{self.name}: {self.rows} rows on {self.counts.shape[1]} local experts from {self.counts.shape[0]} "
                f"ranks ({self.rank_factor:.2f}x the balanced share; busiest expert {self.expert_factor:.2f}x)")


def _spread(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _from_expert_rows(rows: list[int], ep: int, name: str, balanced_rows: int) -> ExpertLoad:
    """The load of local experts receiving ``rows`` each, every source rank sending an equal part."""
    counts = torch.tensor([_spread(r, ep) for r in rows], dtype=torch.int64).t().contiguous()
    share = balanced_rows / len(rows)
    return ExpertLoad(counts, name, sum(rows) / balanced_rows, max(rows) / share)


def _check(tokens: int, top_k: int, num_experts: int, ep: int) -> int:
    if tokens < 1 or top_k < 1 or ep < 1:
        raise ValueError(f"expert load: tokens {tokens}, top_k {top_k} and ep {ep} must be >= 1")
    if num_experts % ep:
        raise ValueError(f"expert load: {num_experts} experts do not split over {ep} EP ranks")
    return num_experts // ep


def balanced_load(tokens: int, top_k: int, num_experts: int, ep: int) -> ExpertLoad:
    """Every expert receives the same number of rows (within one): ``tokens x top_k`` rows for the rank."""
    local = _check(tokens, top_k, num_experts, ep)
    total = tokens * top_k
    return _from_expert_rows(_spread(total, local), ep, "balanced", total)


def _capped(weights: list[float], cap: float) -> list[float]:
    """``weights`` normalised to sum 1 with no share above ``cap`` (water-filling: the excess of capped
    experts goes to the others in proportion), since a token picks ``top_k`` distinct experts."""
    share = [w / sum(weights) for w in weights]
    for _ in range(len(share)):
        over = [i for i, s in enumerate(share) if s > cap]
        if not over:
            break
        free = [i for i, s in enumerate(share) if s < cap]
        excess = sum(share[i] - cap for i in over)
        room = sum(share[i] for i in free)
        for i in over:
            share[i] = cap
        for i in free:
            share[i] += excess * share[i] / room
    return share


def _busiest_rank(shares: list[float], tokens: int, top_k: int, ep: int, name: str) -> ExpertLoad:
    local = len(shares) // ep
    total = tokens * top_k * ep  # rows routed by all ranks together
    per_rank = [shares[r * local:(r + 1) * local] for r in range(ep)]
    hot = max(per_rank, key=sum)
    rows = [round(total * s) for s in hot]
    return _from_expert_rows(rows, ep, name, tokens * top_k)


def zipf_load(tokens: int, top_k: int, num_experts: int, ep: int, exponent: float, seed: int = 0) -> ExpertLoad:
    """The busiest rank when expert popularity falls as ``1 / rank^exponent`` (rank 1 = the most popular),
    capped at one row per token (``1 / top_k`` of all rows), the experts placed on EP ranks at random."""
    _check(tokens, top_k, num_experts, ep)
    if exponent < 0:
        raise ValueError(f"expert load: zipf exponent {exponent} must be >= 0 (0 = balanced)")
    weights = [(i + 1) ** -exponent for i in range(num_experts)]
    random.Random(seed).shuffle(weights)
    return _busiest_rank(_capped(weights, 1.0 / top_k), tokens, top_k, ep, f"zipf:{exponent:g}")


def measured_load(per_expert: list[float], tokens: int, top_k: int, ep: int) -> ExpertLoad:
    """The busiest rank of a measured per-expert count (e.g. a layer's ``tokens_per_expert``), scaled to this
    microbatch's rows; experts sit on ranks in order (expert e on rank e // local), as EP places them."""
    _check(tokens, top_k, len(per_expert), ep)
    if min(per_expert) < 0 or sum(per_expert) <= 0:
        raise ValueError("expert load: measured counts must be >= 0 and not all 0")
    return _busiest_rank([c / sum(per_expert) for c in per_expert], tokens, top_k, ep, "measured")


LOAD_FORMS = "balanced, zipf:<exponent> (e.g. zipf:0.5) or file:<path.json> (a list of per-expert counts)"


def parse_load(spec: str, tokens: int, top_k: int, num_experts: int, ep: int) -> ExpertLoad:
    """``balanced``, ``zipf:<exponent>`` or ``file:<path>`` (a JSON list of per-expert counts) -> the load."""
    if spec == "balanced":
        return balanced_load(tokens, top_k, num_experts, ep)
    kind, _, value = spec.partition(":")
    if kind == "zipf" and value:
        try:
            exponent = float(value)
        except ValueError:
            raise ValueError(f"expert load {spec!r}: {value!r} is not a number; valid: {LOAD_FORMS}") from None
        return zipf_load(tokens, top_k, num_experts, ep, exponent)
    if kind == "file" and value:
        counts = json.loads(Path(value).read_text())
        if not (isinstance(counts, list) and len(counts) == num_experts
                and all(isinstance(c, (int, float)) for c in counts)):
            raise ValueError(f"expert load {spec!r}: expected a JSON list of {num_experts} numbers")
        return measured_load([float(c) for c in counts], tokens, top_k, ep)
    raise ValueError(f"expert load {spec!r}: valid: {LOAD_FORMS}")
