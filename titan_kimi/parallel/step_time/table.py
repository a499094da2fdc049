"""The measured per-layer table the step-time estimate reads (``step_time_h200.json`` beside this package,
written by ``scripts/bench/rank_slice.py``; never by hand), and how the estimate looks a layer up in it.

Entries are keyed by the model geometry (``geometry_key``) and the layer kind (``stage_work.layer_kind``); each
holds one measurement: tokens of the microbatch, the activation-checkpointing mode, the expert load, forward
and backward ms and the model FLOPs of both. A lookup at another token count takes the achieved FLOP rate of
the nearest measured token counts (interpolated on log tokens; constant beyond the ends) and divides the
wanted FLOPs by it. A lookup under another checkpointing mode moves one forward in or out of the backward
(full recomputes the whole layer; none recomputes nothing; selective ``op`` is counted as half a forward).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.parallel.step_time.stage_work import without_block_start

SHIPPED_TABLE = Path(__file__).resolve().parent.parent / "step_time_h200.json"
FORMAT = 1
RECOMPUTE_SHARE = {"none": 0.0, "full": 1.0, "selective": 0.5}  # forwards recomputed inside the backward
# Checkpointing that recomputes the whole forward but for outputs it keeps: a measured entry's backward holds its
# real recompute; entries of other checkpointing count a whole forward (so they overstate it, never understate).
KEEPS_OUTPUTS = ("selective/mixers",)
# Padding tokens skip the routed experts (``LatentMoE``); entries measured before that routed them ("routed"):
# their FLOPs count the padding's expert rows, so a lookup times them on those FLOPs (an upper bound).
PADDING_ROUTED, PADDING_SKIPPED = "routed", "skipped"
# A MoE entry records its rank: the routed experts it holds and the EP dispatch its stand-in ran; entries from
# before either was recorded hold 0 (unknown) and ran the flat dispatch's stand-in.
FLAT = "flat"


def record_rank(record: Mapping[str, Any]) -> tuple[int, str]:
    """A table record's (local experts, EP dispatch), its defaults where it lacks them."""
    return record.get("local_experts", 0), record.get("dispatch", FLAT)


def geometry_key(args: KimiK3ModelArgs) -> str:
    """The model widths that decide a layer's speed (not its depth)."""
    a = args
    return (f"dim{a.dim}-kda{a.kda_num_heads}x{a.kda_head_dim}-mla{a.n_heads}-q{a.q_lora_rank}-kv{a.kv_lora_rank}"
            f"-idx{a.index_n_heads}x{a.index_head_dim}k{a.index_topk}-moe{a.num_experts}top{a.num_experts_per_tok}"
            f"x{a.moe_inter_dim}-lat{a.moe_latent_dim}-sh{a.num_shared_experts}-dense{a.inter_dim}"
            f"-vocab{a.vocab_size}")


def ac_share(mode: str, option: str = "op") -> float:
    """Forwards a block under activation-checkpointing ``mode`` recomputes in its backward (a checkpointed one
    of every N-th: one; mixers: one, less the token mixers, which only its own measured entries time); which
    blocks are checkpointed is ``activation_checkpoint.checkpointed_blocks``."""
    if mode == "selective" and option != "op":
        return 1.0
    return RECOMPUTE_SHARE[mode]


def checkpointing(cfg: Any) -> str:
    """A job's activation checkpointing as a table records it: none, full, or selective/<option>."""
    ac = cfg.activation_checkpoint
    return f"selective/{ac.selective_ac_option}" if ac.mode == "selective" else ac.mode


# The settings each entry records beside its times (a record without one ran under the default), by record key:
# the config key it was measured under and that key's default.
# Entries before the checkpointing was recorded all ran under full checkpointing.
MEASURED_UNDER = {"compile": ("compile.mode", "none"), "expert_gemm": ("training.routed_expert_gemm", "default"),
                  "checkpointing": ("activation_checkpoint", "full")}


def measured_settings(cfg: Any) -> dict[str, str]:
    """A job config's values of the MEASURED_UNDER settings, by record key."""
    out = {}
    for key, (config_key, _) in MEASURED_UNDER.items():
        if key == "checkpointing":
            out[key] = checkpointing(cfg)
            continue
        section, name = config_key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    return out


@dataclass(frozen=True)
class Measured:
    tokens: int
    forward_ms: float
    backward_ms: float
    forward_flops: float
    backward_flops: float
    ac: float  # forwards recomputed inside backward_ms
    load: str
    compile: str = "none"  # the compile.mode it was measured under
    expert_gemm: str = "default"  # the training.routed_expert_gemm it was measured under
    checkpointing: str = "full"  # the activation checkpointing it was measured under (``checkpointing``)
    padding: str = PADDING_ROUTED  # whether its padding tokens ran the routed experts
    local_experts: int = 0  # the routed experts of its rank (a MoE layer's; 0: not recorded)
    dispatch: str = FLAT  # the EP dispatch its MoE ran under (a MoE layer's)

    @property
    def forward_rate(self) -> float:
        return self.forward_flops / self.forward_ms if self.forward_ms else 0.0

    @property
    def backward_rate(self) -> float:
        """FLOP/ms of the backward itself (its recomputed forward taken out at the forward's rate)."""
        own = self.backward_ms - self.ac * self.forward_ms
        return self.backward_flops / own if own > 0 and self.backward_flops else 0.0


class Table:
    """A loaded table (``path``), or none: ``missing`` says why, and every lookup returns None."""

    def __init__(self, data: dict[str, Any] | None, path: Path, missing: str = "") -> None:
        self.data, self.path, self.missing = data, path, missing

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Table":
        p = Path(path) if path else SHIPPED_TABLE
        if not p.is_file():
            return cls(None, p, f"no measured table at {p} (scripts/bench/rank_slice.py writes it on a GPU)")
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{p}: not a step-time table of format {FORMAT}; regenerate it with "
                             "scripts/bench/rank_slice.py")
        return cls(data, p)

    @property
    def hardware(self) -> str:
        return self.data.get("hardware", "?") if self.data else "none"

    def raw(self, geometry: str, section: str) -> dict[str, list[dict[str, Any]]]:
        """The stored records of one section of one geometry, by kind."""
        if not self.data:
            return {}
        return self.data.get("geometries", {}).get(geometry, {}).get(section, {})

    def tokens_measured(self, geometry: str, section: str) -> set[int]:
        """The microbatch token counts any kind of ``section`` was measured at."""
        return {r["tokens"] for rows in self.raw(geometry, section).values() for r in rows if r.get("tokens")}

    def entries(self, geometry: str, section: str, kind: str) -> list[Measured]:
        rows = self.raw(geometry, section).get(kind, [])
        return [_measured(r) for r in rows]

    def measured_under(self, geometry: str, key: str) -> set[str]:
        """The values of setting ``key`` (of MEASURED_UNDER) the geometry's entries were measured under."""
        default = MEASURED_UNDER[key][1]
        return {r.get(key, default) for section in self.data.get("geometries", {}).get(geometry, {}).values()
                for rows in section.values() for r in rows} if self.data else set()

    def moe_dispatches(self, geometry: str) -> set[str]:
        """The EP dispatches the geometry's MoE layer entries ran (an entry without one: the flat dispatch)."""
        return {record_rank(r)[1] for kind, rows in self.raw(geometry, "layers").items() if "+moe" in kind
                for r in rows}

    def time_ms(self, geometry: str, section: str, kind: str, tokens: int, forward_flops: float,
                backward_flops: float, ac: float, load: str = "balanced",
                settings: Mapping[str, str] | None = None,
                padded_flops: tuple[float, float] | None = None,
                local_experts: int = 0, dispatch: str = FLAT) -> tuple[float, float] | None:
        """(forward ms, backward ms incl. ``ac`` recomputed forwards) of ``kind`` at ``tokens`` with these
        FLOPs, from the rates measured nearest in tokens under ``settings`` (``measured_settings``; missing ones
        at their defaults: the entries matching all of them, else the first ones of MEASURED_UNDER, else any) and
        load ``load`` (else balanced); None if the kind was never measured for this geometry. Entries measured
        with the padding skipping the routed experts come first; entries measured with it routed time
        ``padded_flops`` (the same work with the padding's expert rows, when given) instead. Entries of a rank
        holding ``local_experts`` routed experts and measured under EP ``dispatch`` come first
        (``_same_rank_first``)."""
        wanted = [(k, (settings or {}).get(k, default)) for k, (_, default) in MEASURED_UNDER.items()
                  if section == "layers" or k != "checkpointing"]  # only decoder layers are checkpointed
        job_checkpointing = dict(wanted).get("checkpointing")
        # an entry that kept outputs recomputed less than its ``ac`` says: only a job keeping the same reads it
        found = [m for m in self.entries(geometry, section, kind)
                 if m.checkpointing not in KEEPS_OUTPUTS or m.checkpointing == job_checkpointing]
        for n in range(len(wanted), 0, -1):
            matching = [m for m in found if all(getattr(m, k) == v for k, v in wanted[:n])]
            if matching:
                found = matching
                break
        chosen = [m for m in found if m.load == load] or [m for m in found if m.load == "balanced"] or found
        if not chosen:
            return None
        chosen = _same_rank_first(chosen, local_experts, dispatch, lambda m: (m.local_experts, m.dispatch))
        skipped = [m for m in chosen if m.padding == PADDING_SKIPPED]
        if skipped:
            chosen = skipped
        elif padded_flops is not None:
            forward_flops, backward_flops = padded_flops
        fwd_rate = _interpolate(chosen, tokens, lambda m: m.forward_rate)
        bwd_rate = _interpolate(chosen, tokens, lambda m: m.backward_rate)
        fwd = forward_flops / fwd_rate if fwd_rate else 0.0
        bwd = backward_flops / bwd_rate if bwd_rate else 0.0
        return fwd, bwd + ac * fwd

    def saved_gib(self, geometry: str, kind: str, tokens: int, compile_mode: str,
                  local_experts: int = 0, dispatch: str = FLAT) -> float | None:
        """GiB a ``kind`` layer out of activation checkpointing holds after its forward for its backward, at
        ``tokens`` (scaled in proportion from the nearest measured token count; measured under ``compile_mode``
        where the table has that, since Inductor decides what a compiled forward keeps; on a rank like the job's
        where it has that, ``_same_rank_first``); a block start never measured takes its kind's. None if the table
        has no such measurement."""
        for name in (kind, *(k for k in [without_block_start(kind)] if k)):
            rows = [r for r in self.raw(geometry, "layers").get(name, [])
                    if r.get("checkpointing") == "none" and r.get("saved_gib") is not None and r.get("tokens")]
            rows = [r for r in rows if r.get("compile", "none") == compile_mode] or rows
            rows = _same_rank_first(rows, local_experts, dispatch, record_rank)
            if rows:
                nearest = min({r["tokens"] for r in rows}, key=lambda t: abs(math.log(t / tokens)))
                return max(r["saved_gib"] for r in rows if r["tokens"] == nearest) * tokens / nearest
        return None

    def value(self, *keys: str) -> Any:
        node: Any = self.data or {}
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node


def _measured(r: Mapping[str, Any]) -> Measured:
    local_experts, dispatch = record_rank(r)
    return Measured(r["tokens"], r["forward_ms"], r["backward_ms"], r["forward_flops"], r["backward_flops"], r["ac"],
                    r["load"], **{k: r.get(k, default) for k, (_, default) in MEASURED_UNDER.items()},
                    padding=r.get("padding", PADDING_ROUTED), local_experts=local_experts, dispatch=dispatch)


def _same_rank_first(items: list, local_experts: int, dispatch: str, rank_of) -> list:
    """The ``items`` measured on a rank like the job's: ``rank_of(item)`` = (its local experts, its EP dispatch);
    both matching, else the dispatch (the hierarchical one adds local work to a MoE layer), else the local
    experts (the same rows over more experts: smaller GEMMs), else all."""
    for same in (lambda le, d: le == local_experts and d == dispatch, lambda le, d: d == dispatch,
                 lambda le, d: le == local_experts):
        found = [i for i in items if same(*rank_of(i))]
        if found:
            return found
    return items


def _interpolate(points: list[Measured], tokens: int, rate) -> float:
    pts = sorted({m.tokens: rate(m) for m in points if rate(m) > 0}.items())
    if not pts:
        return 0.0
    if tokens <= pts[0][0]:
        return pts[0][1]
    if tokens >= pts[-1][0]:
        return pts[-1][1]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def merge_entries(table: dict[str, Any] | None, geometry: str, section: str, kind: str, entry: dict[str, Any],
                  *, hardware: str, peak_flops: float) -> dict[str, Any]:
    """``table`` (or a new one) with ``entry`` added under ``geometry / section / kind``, replacing an entry of
    the same tokens, checkpointing, load and rows."""
    out = table if table else {"format": FORMAT, "hardware": hardware, "peak_flops": peak_flops, "runs": [],
                               "geometries": {}}
    if out.get("hardware") != hardware:
        raise ValueError(f"the table holds {out.get('hardware')} measurements; this run is on {hardware}: "
                         "write another table file")
    kinds = out["geometries"].setdefault(geometry, {}).setdefault(section, {})
    defaults = {k: default for k, (_, default) in MEASURED_UNDER.items()}  # what an entry without the key ran

    def key(e: dict[str, Any]) -> tuple:
        return (*(e.get(k, defaults.get(k)) for k in ("tokens", "ac", "load", "rows", *MEASURED_UNDER)),
                e.get("padding", PADDING_ROUTED), *record_rank(e))

    kinds[kind] = [e for e in kinds.get(kind, []) if key(e) != key(entry)] + [entry]
    return out
