"""Step time of one layout: measured per-layer times (or the stated FLOP-rate fallback), the communication
model, the pipeline schedule simulated at the recipe's microbatches, and only the overlap the implementation
does. See docs/step_time_model.md for the equations and what overlaps.

What runs where (torchtitan 0.2.2 + torch.distributed.pipelining as this project drives them):
- the EP dispatch and combine (torchtitan's ExpertParallel) are synchronous inside the MoE forward: exposed,
  2 all-to-alls in the forward, 2 in the backward, and 2 more when activation checkpointing recomputes it
  (the hierarchical dispatch: each of them one exchange across nodes, then one inside the node); the shared
  experts run beside one exchange: the hierarchical dispatch's rows crossing nodes (their backward beside those
  rows' gradient crossing back), the flat combine in the forward;
- context-parallel exchanges are synchronous inside the layers: exposed (recomputed under checkpointing too);
- FSDP2 prefetches the next unit's all-gather while a unit computes: only what a layer's compute cannot hide
  is exposed. Under pipeline parallelism the units stay gathered for the step (gathered in the first
  microbatch's forward) and the reduce-scatter runs after the rank's last backward (torch's REDUCE_GRAD
  action): exposed in full. Without pipeline parallelism every microbatch gathers in the forward and again in
  the backward, and reduce-scatters in the backward, each hidden behind one layer's compute where it can be;
- pipeline sends are asynchronous; a stage waits for its input to arrive (latency + bytes / bandwidth);
- DualPipeV's overlapped forward/backward pairs run one after the other (no overlap function is registered);
- hidden or not, every off-node byte crosses the rank's one NIC: the busiest NIC's seconds bound the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lowerings.ops.sequence_shards import parts_per_rank
from titan_kimi.config.parallelism import NODE_GROUPS_VALID, node_groups_problem, planned_node_size
from titan_kimi.data.trim import padded_length, real_length
from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.models.kimi_k3.layer_flops import LayerFlops, row_segments
from titan_kimi.parallel.activation_checkpoint import checkpointed_blocks, saves_expert_exchanges
from titan_kimi.parallel.fsdp import reshard_after_forward
from titan_kimi.parallel.layout import ParallelLayout
from titan_kimi.parallel.pipeline_plan import PipelinePlan
from titan_kimi.parallel.rank_slice.microbatch import DEFAULT_ROWS, doc_ids_for, image_grid, parse_rows
from titan_kimi.parallel.stage_params import (StageParams, compute_dtype, count_stage_params, holding_from_config,
                                              rank_bytes)
from titan_kimi.parallel.step_time.comm import Network, ep_all_to_all_bytes, nodes_per_token
from titan_kimi.parallel.step_time.schedules import (StageTimes, peak_in_flight, rank_orders, simulate,
                                                     uses_split_backward)
from titan_kimi.parallel.step_time.stage_work import (StageWork, shared_expert_flops, stage_work,
                                                      without_block_start)
from titan_kimi.parallel.step_time.kept_outputs import kept_bytes
from titan_kimi.parallel.step_time.table import (FLAT, MEASURED_UNDER, Table, ac_share, checkpointing,
                                                 geometry_key, measured_settings)

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e: the optimizer step's bound when no measured time per parameter exists
OPTIMIZER_BYTES = 16  # per bf16 parameter: read weight, gradient, 2 moments; write weight, 2 moments (+ slack)


@dataclass(frozen=True)
class Settings:
    """What the estimate reads besides the layout: the network, the table, the expert load, the fallback."""

    network: Network
    table: Table
    expert_load: str  # balanced | skewed (the table's non-balanced MoE measurements)
    fallback_mfu: float
    peak_flops: float
    memory_gib: float


@dataclass
class StepEstimate:
    layout: ParallelLayout
    step_s: float
    terms: dict[str, float]  # seconds on the critical rank by cause
    tokens_per_s_per_gpu: float
    mfu: float
    memory_gib: float | None  # the fullest rank's
    memory_note: str
    compute_source: str  # "measured (<table>)" or the fallback's description
    fsdp: str = ""  # how FSDP handles the gathered weights when it is not the default
    config: Any = field(default=None, repr=False)  # the job config estimated

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def _scaled(f: LayerFlops, factor: float) -> LayerFlops:
    return LayerFlops(f.forward * factor, f.backward_input * factor, f.backward_weight * factor)


class StepTimeModel:
    """The step time of layouts of one recipe (``cfg``, ``args``, its vision tower ``vision``)."""

    def __init__(self, cfg, args: KimiK3ModelArgs, vision, settings: Settings,
                 counts: dict[tuple[int, int], StageParams] | None = None) -> None:
        self.cfg, self.args, self.vision, self.s = cfg, args, vision, settings
        self._counts = {} if counts is None else counts  # per layer range, shared by with_config
        self.geometry = geometry_key(args)
        ac = cfg.activation_checkpoint
        self.ac = ac_share(ac.mode, ac.selective_ac_option)  # forwards a checkpointed block recomputes
        # the share of the expert exchanges a checkpointed block's recomputed forward repeats
        self.ep_ac = 0.0 if saves_expert_exchanges(ac.mode, ac.selective_ac_option) else self.ac
        spec = cfg.step_time.rows or DEFAULT_ROWS[cfg.data.dataset]
        try:
            self.rows_layout = parse_rows(spec)
            row = doc_ids_for(self.rows_layout, cfg.training.seq_len, self._image_tokens())
        except ValueError as err:
            raise ValueError(f"step_time.rows = {cfg.step_time.rows!r} (row layout {spec!r}): {err}; set "
                             "step_time.rows to a layout that fits training.seq_len") from None
        # the length a microbatch runs at (training.pad_to_multiple_of cuts the padding after the last real
        # token); memory is sized for whole rows (a batch's longest row may fill seq_len)
        self.row_len = padded_length(real_length(row.unsqueeze(0)), cfg.training.pad_to_multiple_of,
                                     cfg.training.seq_len)
        # padding tokens skip the routed experts: only real tokens' rows are exchanged and computed
        self.real_fraction = float((row[:self.row_len] != 0).float().mean())
        self.dtype = compute_dtype(cfg)

    def checkpointed(self, n_layers: int) -> list[bool]:
        """Which of a stage's ``n_layers`` layers run under checkpointing, in order."""
        ac = self.cfg.activation_checkpoint
        return checkpointed_blocks(n_layers, ac.mode, ac.selective_ac_option, ac.uncheckpointed_blocks)

    def with_config(self, cfg) -> "StepTimeModel":
        """The same recipe under another layout's config (the parameter counts are shared)."""
        return StepTimeModel(cfg, self.args, self.vision, self.s, self._counts)

    def stage_counts(self, layer_range: tuple[int, int]) -> StageParams:
        """Parameter counts of the stage holding ``layer_range`` (a meta-device build, once per range)."""
        if layer_range not in self._counts:
            from titan_kimi.training.setup.build import build_meta_model

            model = build_meta_model(self.args, DTYPES[self.cfg.model.dtype], indexer_mode=self.cfg.indexer.mode,
                                     warmup_trains=self.cfg.indexer.warmup_trains,
                                     vision=self.vision, freeze_vision_tower=self.cfg.model.freeze_vision_tower,
                                     layer_range=layer_range)
            self._counts[layer_range] = count_stage_params(model)
        return self._counts[layer_range]

    # ------------------------------------------------------------------ work per microbatch
    def _grids(self) -> list[tuple[int, int, int]]:
        if self.rows_layout.kind != "medpix" or self.vision is None:
            return []
        return [image_grid(self.rows_layout.image, self.vision.patch_size, self.vision.merge_kernel)]

    def _image_tokens(self) -> int:
        kh, kw = self.vision.merge_kernel if self.vision is not None else (1, 1)
        return sum(h // kh * (w // kw) for _, h, w in self._grids())

    def _row(self, seq_len: int):
        return doc_ids_for(self.rows_layout, seq_len, self._image_tokens()), self._grids()

    def load_factor(self, ep: int) -> tuple[float, str]:
        """Rows the busiest of ``ep`` EP ranks receives over the balanced share, under the load the table's
        skewed MoE measurement used."""
        if self.s.expert_load == "balanced" or ep == 1:
            return 1.0, "balanced"
        loads = {m.load for kind in ("kda+moe", "dsa+moe", "mla+moe")
                 for m in self.s.table.entries(self.geometry, "layers", kind) if m.load != "balanced"}
        if not loads:
            raise ValueError("step_time.expert_load = 'skewed': the table holds no skewed MoE measurement "
                             f"({self.s.table.missing or self.s.table.path}); valid: 'balanced'")
        name = sorted(loads)[0]
        from titan_kimi.parallel.rank_slice.expert_load import parse_load

        a = self.args  # the factor does not depend on the tokens (beyond rounding): any microbatch will do
        return parse_load(name, 4096, a.num_experts_per_tok, a.num_experts, ep).rank_factor, name

    def works(self, layout: ParallelLayout, rows: int, *, padding_routed: bool = False) -> dict[int, StageWork]:
        """Model FLOPs of every stage for one microbatch of ``rows`` whole rows (all CP ranks together);
        ``padding_routed``: with the padding tokens' routed-expert rows counted (as table entries measured before
        padding skipped the experts ran them)."""
        seq_len = self.row_len
        row, grids = self._row(seq_len)
        doc = row.expand(rows, -1)
        segments = row_segments(doc)
        factor, _ = self.load_factor(layout.ep)
        real = 1.0 if padding_routed else self.real_fraction
        routed = int(rows * seq_len * real * self.args.num_experts_per_tok * factor)
        plan = layout.pipeline
        ranges = plan.ranges if plan is not None else ((0, self.args.n_layers),)
        if plan is not None:
            dense = False  # stages decide from the row length alone (PipelineStageModule passes no longest document)
        else:
            from titan_kimi.data.causal_keys import longest_document

            dense = longest_document(doc) <= self.args.index_topk
        return {s: stage_work(self.args, s, r, segments, routed_rows=routed, dsa_dense=dense and self.args.has_indexer,
                              vision=self.vision, grids=grids * rows,
                              tower_trained=not self.cfg.model.freeze_vision_tower)
                for s, r in enumerate(ranges)}

    def _times(self, work: StageWork, tokens: int, cp: int, ep: int,
               padded: StageWork | None = None, dispatch: str = FLAT) -> tuple[float, float, float, list[str]]:
        """(forward, input-gradient, weight-gradient) seconds of one microbatch's compute on one rank of the
        stage (``tokens`` local tokens, ``cp`` ranks sharing the rows), and notes. ``padded``: the stage's work
        with the padding's routed-expert rows, which table entries measured with them routed are timed on;
        ``dispatch``: the layout's EP dispatch (its MoE entries come first)."""
        fwd = b_in = b_w = 0.0
        notes: list[str] = []
        _, load = self.load_factor(ep)
        local_experts = self.args.num_experts // ep

        settings = measured_settings(self.cfg)
        uncheckpointed = {**settings, "checkpointing": "none"}

        def lookup(section: str, kind: str, t: int, flops: LayerFlops, ac: float, with_padding: LayerFlops):
            # the CP ranks share a microbatch's work evenly (zigzag), except the vision tower: each runs it whole
            share = 1.0 if section == "vision" else 1.0 / cp
            f, fp = _scaled(flops, share), _scaled(with_padding, share)
            under = settings if ac else uncheckpointed
            got = self.s.table.time_ms(self.geometry, section, kind, t, f.forward, f.backward, ac, load,
                                       under, padded_flops=(fp.forward, fp.backward), local_experts=local_experts,
                                       dispatch=dispatch)
            inner = without_block_start(kind)
            if got is None and inner is not None:  # a block start never measured: its kind's rates
                got = self.s.table.time_ms(self.geometry, section, inner, t, f.forward, f.backward, ac, load,
                                           under, padded_flops=(fp.forward, fp.backward),
                                           local_experts=local_experts, dispatch=dispatch)
            if got is None:
                rate = self.s.fallback_mfu * self.s.peak_flops
                got = (f.forward / rate * 1e3, f.backward / rate * 1e3 + ac * f.forward / rate * 1e3)
                notes.append(f"{section}/{kind}")
            weight_share = f.backward_weight / f.backward if f.backward else 0.0
            own = got[1] - ac * got[0]  # the recomputed forward belongs to the input half
            return got[0] / 1e3, (got[1] - weight_share * own) / 1e3, weight_share * own / 1e3

        padded = padded or work
        which = self.checkpointed(len(work.layers))
        parts = [("layers", kind, tokens, flops, self.ac if checkpointed else 0.0, with_padding)
                 for (_, kind, flops), (_, _, with_padding), checkpointed in zip(work.layers, padded.layers, which)]
        if work.vision.total:
            t, h, w = self._grids()[0]
            parts.append(("vision", "vision", t * h * w, work.vision, 0.0, work.vision))
        if work.head.total:
            parts.append(("head", "head", tokens, work.head, 0.0, work.head))
        for section, kind, t, flops, ac, with_padding in parts:
            f, i, w = lookup(section, kind, t, flops, ac, with_padding)
            fwd, b_in, b_w = fwd + f, b_in + i, b_w + w
        return fwd, b_in, b_w, notes

    # ------------------------------------------------------------------ communication per microbatch
    def _layer_comm(self, layout: ParallelLayout, layer_range: tuple[int, int],
                    tokens: int) -> tuple[float, float, float, float]:
        """(forward, backward) seconds of the exposed EP and CP exchanges of one microbatch on a stage, the EP
        share of the total, and the seconds they put on the rank's NIC."""
        a, net = self.args, self.s.network
        factor, _ = self.load_factor(layout.ep)
        fwd = bwd = ep_total = nic = 0.0
        latent = a.moe_latent_dim or a.dim
        routed = tokens * self.real_fraction  # padding tokens' rows are not exchanged
        sent = ep_all_to_all_bytes(routed, a.num_experts_per_tok, latent) * factor
        if layout.ep_dispatch == "hierarchical":
            node = planned_node_size(layout.ep_node_size, net.gpus_per_node)
            problem = node_groups_problem(layout.ep, node)
            if problem:
                raise ValueError(f"step time: parallelism.expert_parallel_dispatch = hierarchical over nodes of "
                                 f"{node} ranks (expert_parallel_node_size, else step_time.gpus_per_node): "
                                 f"{problem}; valid: {NODE_GROUPS_VALID}")
            nodes = layout.ep // node
            across = ep_all_to_all_bytes(routed, 1, latent) * nodes_per_token(a.num_experts, a.num_experts_per_tok,
                                                                               nodes) * factor
            one, one_nic = net.node_all_to_all(across, nodes, sent, node), net.nic_node_all_to_all(across, nodes)
            # the shared experts run beside the dispatch's rows leg across nodes, forward and backward
            leg, leg_backward = one_nic, True
        else:
            one, one_nic = net.all_to_all(sent, layout.ep), net.nic_all_to_all(sent, layout.ep)
            # beside torchtitan's combine in the forward; its backward's exchanges wait at once
            leg, leg_backward = one, False
        rows = layout.microbatch_size if layout.pipeline is not None else self.cfg.training.local_batch_size
        whole = rows * self.row_len  # the CP group's tokens
        for layer, checkpointed in zip(range(*layer_range), self.checkpointed(layer_range[1] - layer_range[0])):
            ac, ep_ac = (self.ac, self.ep_ac) if checkpointed else (0.0, 0.0)
            if a.is_moe_layer(layer) and layout.ep > 1:
                hide_f, hide_b = self._beside_shared_experts(layer, tokens, leg, leg_backward)
                fwd += 2 * one - hide_f
                bwd += (2 + 2 * ep_ac) * one - hide_b - ep_ac * hide_f
                ep_total += (4 + 2 * ep_ac) * one - (1 + ep_ac) * hide_f - hide_b
                nic += (4 + 2 * ep_ac) * one_nic
            if layout.cp > 1:
                if a.is_kda_layer(layer):
                    state = rows * a.kda_num_heads * a.kda_head_dim * a.kda_head_dim * 4 * 2 * layout.cp
                    x, x_nic = net.ring(state, layout.cp), net.nic_ring(state, layout.cp)
                else:
                    latent_cp = whole * (a.kv_lora_rank + a.qk_rope_head_dim) * 2
                    keys = whole * a.index_head_dim * 2 if a.has_indexer else 0.0
                    x = net.ring(latent_cp, layout.cp) + net.ring(keys, layout.cp)
                    x_nic = net.nic_ring(latent_cp, layout.cp) + net.nic_ring(keys, layout.cp)
                fwd += x
                bwd += x * (1 + ac)
                nic += x_nic * (2 + ac)
        return fwd, bwd, ep_total, nic

    def _beside_shared_experts(self, layer: int, tokens: int, leg: float, backward: bool) -> tuple[float, float]:
        """Seconds of a MoE layer's exchange ``leg`` hidden by its shared experts in a forward and in a backward
        (``backward`` False: none there). The hierarchical dispatch runs their forward while the rows cross nodes
        and their backward while the rows' gradient crosses back (``parallel/overlapped_exchange.py``); under the
        flat dispatch they run while torchtitan's combine exchange is in flight (``GroupedExperts.route``), whose
        backward waits at once. Their time: their FLOPs at ``step_time.fallback_mfu`` (the table times whole
        layers, not the shared experts)."""
        if leg <= 0.0:
            return 0.0, 0.0
        shared = shared_expert_flops(self.args, layer, tokens)
        rate = self.s.fallback_mfu * self.s.peak_flops
        return min(leg, shared.forward / rate), min(leg, shared.backward / rate) if backward else 0.0

    def _boundary_bytes(self, layer: int, tokens: int) -> float:
        """Hidden state and AttnRes bank crossing to the next stage after ``layer`` (and its gradient back)."""
        block = self.args.attn_res_block_size
        entries = layer // block if block else 0
        return tokens * self.args.dim * 2 * (1 + entries)

    # ------------------------------------------------------------------ the step
    def estimate(self, layout: ParallelLayout) -> StepEstimate:
        cfg, a, net = self.cfg, self.args, self.s.network
        t = cfg.training
        plan = layout.pipeline
        rows = layout.microbatch_size if plan is not None else t.local_batch_size
        global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * layout.dp
        accum = global_batch // (t.local_batch_size * layout.dp)
        n_micro = (t.local_batch_size // rows if plan is not None else 1) * accum
        tokens = rows * self.row_len // layout.cp
        works = self.works(layout, rows)
        # the work table entries measured with the padding routed are timed on (the same work without padding)
        padded_works = works if self.real_fraction == 1 else self.works(layout, rows, padding_routed=True)
        ranges = plan.ranges if plan is not None else ((0, a.n_layers),)
        # gathered once, in the first microbatch's forward, or again in every forward and backward
        keep = not reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, pipeline=plan is not None)
        # reduce-scattered once after the last backward (torch's REDUCE_GRAD), or in every backward
        holding = holding_from_config(cfg, layout)
        step_sync, wbytes, reduce_bytes = holding.accumulate_grads, self.dtype.itemsize, holding.reduce
        times, first_forward, transfer, notes = {}, {}, {}, []
        ep_per_stage, comm_f, comm_b, fsdp_end, fsdp_micro, gathers, layer_forward = {}, {}, {}, {}, {}, {}, {}
        nic_micro, nic_step, boundary = {}, {}, {}  # seconds on the rank's NIC per microbatch and per step
        counts = {s: self.stage_counts(r) for s, r in enumerate(ranges)}
        for s, work in works.items():
            f, i, w, missing = self._times(work, tokens, layout.cp, layout.ep, padded_works[s], layout.ep_dispatch)
            notes += missing
            cf, cb, ep, nic_micro[s] = self._layer_comm(layout, ranges[s], tokens)
            comm_f[s], comm_b[s], ep_per_stage[s] = cf, cb, ep
            units = self._fsdp_units(layout, counts[s], len(work.layers), wbytes, reduce_bytes)
            gather = [net.ring(g, n, stride) for g, _, n, stride in units]
            scatter = [net.ring(r, n, stride) for _, r, n, stride in units]
            gather_nic = sum(net.nic_ring(g, n, stride) for g, _, n, stride in units)
            scatter_nic = sum(net.nic_ring(r, n, stride) for _, r, n, stride in units)
            # once per step (gathered for the step / reduced after the last backward) or every microbatch
            nic_step[s] = (gather_nic if keep else 0.0) + (scatter_nic if step_sync else 0.0)
            nic_micro[s] += (0.0 if keep else 2 * gather_nic) + (0.0 if step_sync else scatter_nic)
            layer_f, layer_b = f / max(1, len(gather)), (i + w) / max(1, len(gather))
            exposed_ag = _exposed(gather, layer_f)
            gathers[s], layer_forward[s] = gather, layer_f
            # a unit's reduce-scatter in the backward hides behind the next unit's backward where it can
            scatter_micro = 0.0 if step_sync else sum(max(0.0, x - layer_b) for x in scatter)
            fsdp_end[s] = sum(scatter) if step_sync else 0.0
            if keep:
                first_forward[s], fsdp_micro[s] = exposed_ag, (0.0, scatter_micro)
            else:  # every microbatch gathers in the forward and again in the backward
                first_forward[s], fsdp_micro[s] = 0.0, (exposed_ag, _exposed(gather, layer_b) + scatter_micro)
            times[s] = StageTimes(f + cf + fsdp_micro[s][0], i + cb + fsdp_micro[s][1], w)
            if plan is not None and s + 1 < plan.num_stages:
                boundary[s] = self._boundary_bytes(ranges[s][1], tokens)
                transfer[s] = net.point_to_point(boundary[s], layout.world_size // layout.pp)
        for s, nbytes in boundary.items():  # the activations out of stage s, their gradient out of stage s + 1
            sent = net.nic_point_to_point(nbytes, layout.world_size // layout.pp)
            nic_micro[s] += sent
            nic_micro[s + 1] += sent
        if plan is None:
            plan_used = PipelinePlan("GPipe", 1, 1, ranges)
        else:
            plan_used = plan
        split = uses_split_backward(plan_used.schedule)
        if not split:
            times = {s: StageTimes(v.forward, v.backward_input + v.backward_weight, 0.0) for s, v in times.items()}
        bare = simulate(plan_used, n_micro, times)  # the schedule alone: its bubble
        if keep and cfg.parallelism.pipeline_prefetch_weights:
            # every gather issued at the step's start: only what the wait for the first input cannot hide
            arrived = simulate(plan_used, n_micro, times, transfer).first_forward_start
            first_forward = {s: _exposed_after(gathers[s], layer_forward[s], arrived.get(s, 0.0)) for s in times}
        timeline = simulate(plan_used, n_micro, times, transfer, first_forward)
        gathered = simulate(plan_used, n_micro, times, first_forward=first_forward)  # + the first gathers' delays
        # the step ends on the rank that finishes last: its timeline, its reduce-scatter, its optimizer step
        ends, optimizers = {}, {}
        for r in range(plan_used.pp):
            stages = plan_used.stages_of_rank(r)
            optimizers[r] = self._optimizer_s(layout, [counts[s] for s in stages])
            ends[r] = timeline.end[r] + sum(fsdp_end[s] for s in stages) + optimizers[r]
        critical = max(ends, key=ends.get)
        stages = plan_used.stages_of_rank(critical)
        optimizer = optimizers[critical]
        step = ends[critical] + 2 * net.latency  # the grad-norm and replicated-gradient all-reduces
        per_micro = lambda values: sum(values[s] for s in stages) * n_micro
        idle = lambda line: line.end[critical] - line.busy[critical]
        # the first gathers delay the ranks downstream too: their waiting counts as FSDP's
        fsdp = (sum(first_forward[s] + fsdp_end[s] for s in stages) + max(0.0, idle(gathered) - idle(bare))
                + per_micro({s: sum(fsdp_micro[s]) for s in stages}))
        ep_s = per_micro(ep_per_stage)
        comm = per_micro({s: comm_f[s] + comm_b[s] for s in stages})
        busy = per_micro({s: times[s].forward + times[s].backward_input + times[s].backward_weight for s in stages})
        terms = {
            "compute": busy - comm - per_micro({s: sum(fsdp_micro[s]) for s in stages}),
            "EP all-to-all": ep_s,
            "CP exchanges": comm - ep_s,
            "pipeline bubble": idle(bare),
            "PP transfers": max(0.0, idle(timeline) - max(idle(gathered), idle(bare))),
            "FSDP (exposed)": fsdp,
            "optimizer": optimizer,
        }
        # Every off-node byte of the step crosses the rank's NIC however the collectives overlap with compute and
        # each other: the busiest NIC's seconds (+ its optimizer step) bound the step from below.
        nic = max(sum(nic_micro[s] * n_micro + nic_step[s] for s in plan_used.stages_of_rank(r)) + optimizers[r]
                  for r in range(plan_used.pp)) + 2 * net.latency
        if nic > step:
            terms["NIC contention"] = nic - step
            step = nic
        step_flops = sum(w.total.total for w in works.values()) * n_micro * layout.dp
        step_tokens = global_batch * self.row_len
        memory, memory_note = self._memory(layout, plan_used, n_micro, counts, rows * t.seq_len // layout.cp, works)
        source = (f"measured ({self.s.table.path.name}, {self.s.table.hardware})" if not notes else
                  f"FLOP-rate fallback at {self.s.fallback_mfu:.0%} of peak for {sorted(set(notes))} "
                  f"({self.s.table.missing or 'not in the table'}): not measured")
        for key, wanted in measured_settings(cfg).items():
            measured = self.s.table.measured_under(self.geometry, key)
            if measured and wanted not in measured:
                source += (f"; the table's layer times were measured under {MEASURED_UNDER[key][0]} "
                           f"{' / '.join(sorted(measured))}, not this config's {wanted}")
        dispatches = self.s.table.moe_dispatches(self.geometry) if layout.ep > 1 else set()
        if dispatches and layout.ep_dispatch not in dispatches:
            source += (f"; the MoE layers' times are those of the {' / '.join(sorted(dispatches))} dispatch's "
                       f"stand-in (none measured under {layout.ep_dispatch})")
        p = cfg.parallelism
        fsdp = ", ".join(x for x in (f"reshard_after_forward {p.fsdp_reshard_after_forward}"
                                     if p.fsdp_reshard_after_forward != "default" else "",
                                     "weights prefetched" if p.pipeline_prefetch_weights else "",
                                     "gradients reduced every microbatch"
                                     if plan is not None and p.pipeline_gradient_sync == "microbatch" else "") if x)
        return StepEstimate(layout, step, terms, step_tokens / step / layout.world_size,
                            step_flops / step / layout.world_size / self.s.peak_flops, memory, memory_note, source,
                            fsdp, cfg)

    def _fsdp_units(self, layout: ParallelLayout, c: StageParams, layers: int, wbytes: int,
                    reduce_bytes: int) -> list[tuple[float, float, int, int]]:
        """Each FSDP unit's (all-gather bytes, reduce-scatter bytes, group, rank stride): the dense units over
        fsdp's consecutive ranks; the local experts, units of their own when efsdp > 1, over efsdp's ranks ep
        apart."""
        units = [(u * wbytes, u * c.dense / max(1, c.dense + c.dense_frozen) * reduce_bytes, layout.fsdp, 1)
                 for u in c.units]
        if layout.efsdp > 1 and layers:
            local = (c.experts + c.experts_frozen) / layout.ep / layers
            units += [(local * wbytes, c.experts / layout.ep / layers * reduce_bytes, layout.efsdp, layout.ep)] * layers
        return units

    def _optimizer_s(self, layout: ParallelLayout, counts: list[StageParams]) -> float:
        params = sum((c.dense + c.experts) / layout.fsdp + c.fp32 for c in counts)
        measured = self.s.table.value("optimizer_ns_per_param") or {}
        key = f"{self.cfg.optimizer.implementation}/{self.cfg.optimizer.state_dtype}/{self.dtype}"
        ns = measured.get(key) or (next(iter(measured.values())) if measured else None)
        if ns is not None:
            return params * ns * 1e-9
        return params * OPTIMIZER_BYTES / HBM_BYTES_PER_S

    def _memory(self, layout: ParallelLayout, plan: PipelinePlan, n_micro: int, counts: dict[int, StageParams],
                tokens: int, works: dict[int, StageWork]) -> tuple[float | None, str]:
        """The fullest rank's GiB: its parameters' bytes (``stage_params.rank_bytes``) + the activations its
        schedule holds per microbatch in flight (each layer's input and the block banks; a checkpointed layer
        under ``mixers`` also its token mixer's outputs, ``kept_outputs``; a layer out of checkpointing what it
        holds after its forward, measured) + the largest measured transient of one layer's recompute or
        backward."""
        a, cfg = self.args, self.cfg
        mode = checkpointing(cfg)
        if mode == "selective/op":
            return None, ("activation checkpointing selective/op: its kept outputs are not modelled (use "
                          "job.estimate_activations)")
        orders = rank_orders(plan, n_micro) if plan.pp > 1 else {0: []}
        worst, note = 0.0, ""
        holding = holding_from_config(cfg, layout)
        for r in range(plan.pp):
            stages = plan.stages_of_rank(r)
            held = sum(rank_bytes(counts[s], fsdp=layout.fsdp, efsdp=layout.efsdp, holding=holding).total
                       for s in stages)
            flight = peak_in_flight(orders[r]) if plan.pp > 1 else {stages[0]: 1}
            acts, kept_one, recomputes = 0.0, 0.0, {}  # kinds by the forwards they recompute
            for s in stages:
                first, last = plan.ranges[s]
                block = a.attn_res_block_size
                banks = sum((l // block) for l in range(first, last) if block and l % block == 0)
                per_micro = tokens * a.dim * 2 * ((last - first) + 1 + banks)
                kept = 0.0
                # per row under CP: the KDA op keeps the incoming state of each of the rank's sequence parts
                rows = tokens * layout.cp // cfg.training.seq_len
                parts = rows * parts_per_rank(layout.cp_layout) if layout.cp > 1 else 0
                for (_, kind, _), checkpointed in zip(works[s].layers, self.checkpointed(last - first)):
                    recomputes.setdefault(self.ac if checkpointed else 0.0, set()).add(kind)
                    if checkpointed and mode == "selective/mixers":
                        per_micro += kept_bytes(a, kind, tokens, state_parts=parts)
                    elif not checkpointed:
                        saved = self.s.table.saved_gib(self.geometry, kind, tokens, self.cfg.compile.mode,
                                                       a.num_experts // layout.ep, layout.ep_dispatch)
                        if saved is None:
                            return None, (f"the table ({self.s.table.path.name}) holds no {kind} layer measured "
                                          "without checkpointing: scripts/bench/rank_slice.py with "
                                          "--activation_checkpoint.mode none measures what it holds")
                        kept += saved * 2**30
                acts += flight.get(s, 1) * (per_micro + kept)
                kept_one = max(kept_one, kept)
            # The backward meets the kept layers first (each stage's last): their backward's temporaries come
            # while every kept activation is held; a checkpointed layer recomputes after the microbatch's own
            # kept layers have freed theirs.
            phases = [self._transient(tokens, ac, recomputes[ac]) for ac in sorted(recomputes)]
            transient = None if any(p is None for p in phases) else max(
                (p - (kept_one / 2**30 if ac else 0.0) for ac, p in zip(sorted(recomputes), phases)), default=0.0)
            total = (held + acts) / 2**30 + (transient or 0.0)
            if total > worst:
                worst = total
                note = ("" if transient is not None else
                        "without a measured table the transient of a layer's recompute is not counted")
        return worst, note

    def _transient(self, tokens: int, ac: float, kinds: set[str] | None = None) -> float | None:
        """GiB above what the forwards left while one layer of ``kinds`` (recomputing ``ac`` forwards) runs its
        backward: the largest measured peak of such a block so checkpointed, less what its forward held, scaled to
        ``tokens`` from the measurements at the nearest token count (a peak also holds parts that do not grow
        with the tokens: scaled far, it overstates). Kinds the table lacks (a block start: its kind's), or
        lacks so checkpointed, leave every measured kind to choose from."""
        raw = self.s.table.raw(self.geometry, "layers")
        names = None if kinds is None else {k if k in raw else without_block_start(k) for k in kinds}
        if names is not None and not names <= raw.keys():
            names = None
        peaks = [(r["tokens"], (r["peak_gib"] - (r.get("saved_gib") or 0.0)) * tokens / r["tokens"])
                 for kind, rows in raw.items() if names is None or kind in names for r in rows
                 if r.get("peak_gib") is not None and r.get("tokens") and r.get("ac") == ac]
        if not peaks:
            return None if names is None else self._transient(tokens, ac)
        nearest = min({t for t, _ in peaks}, key=lambda t: abs(math.log(t / tokens)))
        return max(p for t, p in peaks if t == nearest)


def _exposed_after(gathers: list[float], layer_compute: float, wait: float) -> float:
    """The gathers all issued at time 0, back to back; unit i computes once they are done and not before the
    stage's input arrived (``wait``) plus i layers of compute: how much later the stage's first forward ends."""
    done, worst = 0.0, 0.0
    for i, g in enumerate(gathers):
        done += g
        worst = max(worst, done - (wait + i * layer_compute))
    return worst


def _exposed(gathers: list[float], layer_compute: float) -> float:
    """What FSDP's one-unit prefetch cannot hide: the first unit's gather, then whatever of each next unit's
    gather is longer than one layer's compute."""
    if not gathers:
        return 0.0
    return gathers[0] + sum(max(0.0, g - layer_compute) for g in gathers[1:])
