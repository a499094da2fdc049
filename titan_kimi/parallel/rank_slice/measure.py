"""Measurements of a rank slice: each decoder-layer kind on its own (the block as built, with its activation
checkpointing, and its attention and FFN apart), the vision tower per image, the head and loss, the optimizer
step per parameter, and the rank's whole schedule over its microbatches (per-stage forward / backward times and
the peak memory with as many microbatches in flight as the schedule holds).

Every entry carries its model FLOPs (``titan_kimi.models.kimi_k3.layer_flops``) so that its rate and MFU read
against the floor; a backward under activation checkpointing includes the recomputed forward (executed work
that the model FLOPs, and so the MFU, leave out).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import torch

from titan_kimi.models.kimi_k3.layer_flops import (LayerFlops, attention_part_flops, block_flops, ffn_part_flops,
                                                   head_flops, row_segments)
from titan_kimi.models.kimi_k3.vision_accounting import vision_flops
from titan_kimi.parallel.pipeline_images import unpad_images
from titan_kimi.parallel.rank_slice.build import RankSlice
from titan_kimi.parallel.rank_slice.microbatch import Microbatch
from titan_kimi.parallel.rank_slice.timing import (Stopwatch, allocated, gib, median_phases, peak, reset_peak,
                                                  synchronize)
from titan_kimi.parallel.step_time.schedules import BACKWARD, FORWARD, INPUT, Action, peak_in_flight, rank_orders
from titan_kimi.parallel.step_time.stage_work import layer_kind


@dataclass
class Entry:
    """One measured item: ``forward_ms`` / ``backward_ms`` medians, its FLOPs, memory above what was allocated
    when its run started (``saved_gib`` held after the forward for the backward, ``peak_gib`` at its peak)."""

    name: str
    kind: str  # block | attention | ffn | vision | head | optimizer | stage
    tokens: int
    forward_ms: float
    backward_ms: float
    flops: LayerFlops
    saved_gib: float | None = None
    peak_gib: float | None = None
    note: str = ""
    load: str = ""  # the expert load of an MoE entry
    rows: str = ""  # the microbatch's row layout
    checkpointed: bool = False  # a block item that ran under activation checkpointing
    host_forward_ms: float | None = None  # the host's ms of the same calls (``Timed``)
    host_backward_ms: float | None = None

    def row(self, peak_flops: float) -> dict:
        out = asdict(self)
        out["flops"] = asdict(self.flops)
        total_ms = self.forward_ms + self.backward_ms
        out["forward_tflops"] = self.flops.forward / self.forward_ms / 1e9 if self.forward_ms else None
        out["backward_tflops"] = self.flops.backward / self.backward_ms / 1e9 if self.backward_ms else None
        out["mfu"] = self.flops.total / (total_ms / 1e3) / peak_flops if total_ms and self.flops.total else None
        return out


def _bank_entries(args, layer: int) -> int:
    """Entries of the AttnRes bank a layer receives (the embedding and the finished blocks)."""
    block = args.attn_res_block_size
    if not block:
        return 0
    return layer // block + (0 if layer % block == 0 else 1)


def _sequence(part, mb: Microbatch, max_causal_keys: int | None):
    seq = part.build_sequence(mb.doc_ids.shape[0], mb.doc_ids.shape[1], mb.doc_ids.device, mb.doc_ids)
    seq.dsa_dense = part.dsa_dense(seq, max_causal_keys)
    return seq


class Timed(NamedTuple):
    """Medians of one item's runs: device ms of the forward and the backward (the GPU's clock), host ms of the
    same calls (the Python thread's, from the call until it returns with every kernel queued: at or above the
    device's, the phase is bound by the host), memory above what a run started with."""

    forward_ms: float
    backward_ms: float
    saved_gib: float | None
    peak_gib: float | None
    host_forward_ms: float
    host_backward_ms: float


def _timed(fn_forward, device, warmup: int, repeats: int, new_gradients: list | None = None) -> Timed:
    """``fn_forward() -> (outputs, grads)`` then backward, timed. The memory is the last run's above what was
    allocated when that run started: the parameters' gradients, held from the first backward on, belong to the
    rank's states, not to the item's activations; each backward adds its gradients into them. With
    ``new_gradients`` (parameters) those parameters' gradients are dropped before each run, so its backward
    makes them anew, as FSDP training leaves them when it reduces every microbatch; its peak then holds them."""
    synchronize(device)
    last: dict[str, int | None] = {}  # the latest run's memory (each run overwrites it)
    host: list[tuple[float, float]] = []  # every run's host ms, warm-ups first

    def step(watch):
        for p in new_gradients or ():
            p.grad = None
        reset_peak(device)
        before = allocated(device)
        a = watch.mark()
        t0 = time.perf_counter()
        # a new CUDA-graph generation per run, as the model's forward starts one in training (the items call
        # blocks directly); the previous run's outputs are dead by now. A no-op without CUDA graphs.
        torch.compiler.cudagraph_mark_step_begin()
        outs, grads = fn_forward()
        t1 = time.perf_counter()
        b = watch.mark()
        after = allocated(device)
        last["saved"] = None if after is None else after - before
        if any(o.requires_grad for o in outs):  # (a frozen module's output has no backward)
            torch.autograd.backward(outs, grads)
        t2 = time.perf_counter()
        c = watch.mark()
        top = peak(device)
        last["peak"] = None if top is None else top - before
        host.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
        return [a, b, c]

    fwd, bwd = median_phases(step, device, warmup, repeats)
    timed = host[warmup:] or host
    return Timed(fwd, bwd, gib(last["saved"]), gib(last["peak"]), statistics.median(h[0] for h in timed),
                 statistics.median(h[1] for h in timed))


def _random_like(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(x.shape, generator=gen, device="cpu", dtype=torch.float32).to(x.device, x.dtype)


def _layer_inputs(args, layer: int, mb: Microbatch, dtype, device, generator):
    rows, S = mb.doc_ids.shape
    hidden = _random_like(torch.empty(rows, S, args.dim, dtype=dtype, device=device), generator)
    bank = _random_like(torch.empty(rows * S, _bank_entries(args, layer), args.dim, dtype=dtype, device=device),
                        generator)
    return hidden.requires_grad_(True), bank.requires_grad_(True), _random_like(hidden, generator)


BLOCK, ATTENTION, FFN = "block", "attention", "ffn"


@dataclass
class BlockJob:
    """One item of a layer kind: ``run()`` is its forward returning (outputs, output gradients)."""

    label: str
    item: str  # BLOCK | ATTENTION | FFN
    run: Callable[[], tuple[list, list]]
    flops: Callable[[], LayerFlops]
    tokens: int
    load: str  # the expert load of an MoE item
    note: str
    checkpointed: bool = False  # a block item wrapped for activation checkpointing
    params: tuple = ()  # the trainable parameters its backward gives gradients


def block_jobs(rs: RankSlice, mbs: dict[int, Microbatch], *, max_causal_keys: int | None,
               generator: torch.Generator, device: torch.device, what: tuple[str, ...] = (BLOCK, ATTENTION, FFN),
               select: Callable[[str], bool] | None = None):
    """Every distinct layer kind of the built stages once (``select``: only the kinds it accepts): ``block``
    the layer as built (with its AC), ``attention`` its norm and mixer alone, ``ffn`` its norm and MoE or MLP
    alone (both without AC; each distinct one once). MoE items carry the slice's current expert load. Yields
    the items one at a time, so that each one's inputs live only while it is measured."""
    seen: set[str] = set()
    load = rs.load
    routed = load.rows if load is not None else None
    for index, stage in rs.stages:
        part, mb = stage.part, mbs[index]
        args = part.args
        seq = _sequence(part, mb, max_causal_keys)
        segments = row_segments(mb.doc_ids)
        for name, wrapped in part.layers.items():
            layer = int(name)
            kind = layer_kind(args, layer, seq.dsa_dense)
            if select is not None and not select(kind):
                continue
            block = getattr(wrapped, "_checkpoint_wrapped_module", wrapped)
            checkpointed = block is not wrapped
            moe_load = load.name if (load is not None and block.moe_enabled) else ""
            dtype = next(p.dtype for p in block.parameters() if p.dtype != torch.float32)
            hidden, bank, grad_h = _layer_inputs(args, layer, mb, dtype, device, generator)
            ffn = block.moe if block.moe_enabled else block.feed_forward
            attention_name, ffn_name = kind.split(",")[0].split("+")

            def run_block(wrapped=wrapped, hidden=hidden, bank=bank, grad_h=grad_h, seq=seq):
                h, b = wrapped(hidden, bank, seq)
                if b is bank:
                    return [h], [grad_h]
                return [h, b], [grad_h, torch.ones_like(b)]

            def run_attention(block=block, hidden=hidden, grad_h=grad_h, seq=seq):
                return [block.attention(block.attention_norm(hidden), seq)], [grad_h]

            def run_ffn(block=block, hidden=hidden, grad_h=grad_h, ffn=ffn, seq=seq):
                x = block.ffn_norm(hidden)
                return [ffn(x, seq.is_real) if block.moe_enabled else ffn(x)], [grad_h]

            jobs = {
                BLOCK: (kind, run_block, lambda: block_flops(block, args, segments, routed_rows=routed,
                                                             dsa_dense=seq.dsa_dense), moe_load, (block,)),
                ATTENTION: (f"attention {attention_name}", run_attention,
                            lambda: attention_part_flops(block, args, segments, dsa_dense=seq.dsa_dense), "",
                            (block.attention_norm, block.attention)),
                FFN: (f"ffn {ffn_name}", run_ffn, lambda: ffn_part_flops(block, mb.tokens, routed_rows=routed),
                      moe_load, (block.ffn_norm, ffn)),
            }
            for item in what:
                label, run, flops, entry_load, modules = jobs[item]
                if label in seen:
                    continue
                seen.add(label)
                note = load.describe() if entry_load else ""
                params = tuple(p for m in modules for p in m.parameters() if p.requires_grad)
                yield BlockJob(label, item, run, flops, mb.tokens, entry_load, note, item == BLOCK and checkpointed,
                               params)


def measure_blocks(rs: RankSlice, mbs: dict[int, Microbatch], *, max_causal_keys: int | None, warmup: int,
                   repeats: int, generator: torch.Generator, device: torch.device,
                   what: tuple[str, ...] = (BLOCK, ATTENTION, FFN),
                   select: Callable[[str], bool] | None = None, new_gradients: bool = False) -> list[Entry]:
    """The items of ``block_jobs`` timed: forward and backward medians, saved and peak memory; with
    ``new_gradients`` each run's backward makes its parameters' gradients anew (``_timed``)."""
    entries: list[Entry] = []
    for job in block_jobs(rs, mbs, max_causal_keys=max_causal_keys, generator=generator, device=device, what=what,
                          select=select):
        t = _timed(job.run, device, warmup, repeats, list(job.params) if new_gradients else None)
        entries.append(Entry(job.label, job.item, job.tokens, t.forward_ms, t.backward_ms, job.flops(), t.saved_gib,
                             t.peak_gib, job.note, job.load, checkpointed=job.checkpointed,
                             host_forward_ms=t.host_forward_ms, host_backward_ms=t.host_backward_ms))
    return entries


def measure_vision(part, mb: Microbatch, *, warmup: int, repeats: int, generator: torch.Generator,
                   device: torch.device) -> Entry | None:
    """The tower and projector on the microbatch's images (a frozen tower runs without autograd), per image."""
    if not mb.grids or getattr(part, "vision_tower", None) is None:
        return None
    pixels, grids = unpad_images(mb.inputs[1], mb.inputs[2])
    trains = any(p.requires_grad for p in part.vision_tower.parameters())
    projector = any(p.requires_grad for p in part.mm_projector.parameters())
    grad = None

    def run():
        nonlocal grad
        out = part.image_features(pixels, grids)
        grad = _random_like(out, generator) if grad is None else grad
        return [out], [grad]

    t = _timed(run, device, warmup, repeats)
    n = len(mb.grids)
    fwd_flops = vision_flops(part.vision_args, part.args.dim, mb.grids, tower_trained=False,
                             projector_trained=False)
    total = vision_flops(part.vision_args, part.args.dim, mb.grids, tower_trained=trains,
                         projector_trained=projector)
    flops = LayerFlops(fwd_flops / n, (total - fwd_flops) / n / 2, (total - fwd_flops) / n / 2)
    frames, h, w = mb.grids[0]
    return Entry(f"vision tower + projector, per {h * 14}x{w * 14} image", "vision", frames * h * w, t.forward_ms / n,
                 t.backward_ms / n, flops, t.saved_gib, t.peak_gib, f"{frames * h * w} patches; tower "
                 f"{'trained' if trains else 'frozen'}", host_forward_ms=t.host_forward_ms / n,
                 host_backward_ms=t.host_backward_ms / n)


def measure_head(part, loss_fn, mb: Microbatch, *, warmup: int, repeats: int, generator: torch.Generator,
                 device: torch.device, dtype: torch.dtype, note: str = "") -> Entry | None:
    """The last stage's norm, head and loss (``loss_fn``: the trainer's fused linear cross-entropy) on the
    microbatch; None for a part without the head."""
    if part.output is None:
        return None
    rows, S = mb.doc_ids.shape
    hidden = _random_like(torch.empty(rows, S, part.args.dim, dtype=dtype, device=device), generator)
    hidden.requires_grad_(True)
    normalizer = float(max(1, int((mb.labels != -100).sum())))

    def run():
        loss = loss_fn(part.output, part.norm(hidden), mb.labels, normalizer)
        return [loss], [None]

    t = _timed(run, device, warmup, repeats)
    return Entry("norm + head + loss", "head", mb.tokens, t.forward_ms, t.backward_ms, head_flops(part.args, mb.tokens),
                 t.saved_gib, t.peak_gib, note, host_forward_ms=t.host_forward_ms,
                 host_backward_ms=t.host_backward_ms)


def measure_optimizer(block: torch.nn.Module, optimizer_cfg, *, warmup: int, repeats: int,
                      device: torch.device) -> Entry:
    """One optimizer step over a block's trainable parameters (gradients set): its time per parameter scales
    to the rank's shards."""
    from titan_kimi.training.optim.optimizer import build_optimizer

    params = [p for p in block.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer([block], optimizer_cfg)

    def step(watch):
        a = watch.mark()
        opt.step()
        return [a, watch.mark()]

    (ms,) = median_phases(step, device, warmup, repeats)
    numel = sum(p.numel() for p in params)
    opt.state.clear()
    for p in params:
        p.grad = None
    return Entry("optimizer step", "optimizer", numel, ms, 0.0, LayerFlops(0.0, 0.0, 0.0),
                 note=f"{ms * 1e6 / numel:.4g} ns per parameter over {numel} parameters")


@dataclass
class ScheduleRun:
    """The rank's schedule: per stage the median forward and backward ms of one microbatch, the step's span,
    and the peak memory (absolute) with the schedule's microbatches in flight."""

    forward_ms: dict[int, float]
    backward_ms: dict[int, float]
    step_ms: float
    peak_gib: float | None
    in_flight: dict[int, int]


def run_schedule(rs: RankSlice, mbs: dict[int, Microbatch], plan, pp_rank: int, n_microbatches: int, *,
                 steps: int, generator: torch.Generator, device: torch.device,
                 forward: Callable[[int, Microbatch, float], tuple]) -> ScheduleRun:
    """Run pipeline rank ``pp_rank``'s actions in its schedule's order (``plan``; None: every microbatch's
    forward then its backward, as gradient accumulation does) with nothing to wait for: the peers' transfers
    are left out. A weight-gradient action (zero-bubble schedules) costs nothing here: its input half ran the
    whole backward. ``forward(stage, microbatch, normalizer)`` runs one forward and returns its outputs (the
    loss on the last stage). The first steps warm up; the last one is reported."""
    if plan is None:
        order = [a for m in range(n_microbatches) for a in (Action(0, FORWARD, m), Action(0, BACKWARD, m))]
    else:
        order = rank_orders(plan, n_microbatches)[pp_rank]
    normalizer = float(max(1, sum(int((mb.labels != -100).sum()) for mb in mbs.values()) * n_microbatches))
    grads: dict[int, list] = {}
    result = None
    for step_index in range(steps):
        synchronize(device)
        reset_peak(device)
        outputs: dict[tuple[int, int], tuple] = {}
        times: dict[tuple[int, str], list[float]] = {}
        marks = []
        watch = Stopwatch(device)
        first = watch.mark()
        for a in order:
            if a.kind not in (FORWARD, BACKWARD, INPUT):
                continue
            mb = mbs[a.stage]
            begin = watch.mark()
            if a.kind == FORWARD:
                outputs[(a.stage, a.microbatch)] = forward(a.stage, mb, normalizer)
            else:
                outs = outputs.pop((a.stage, a.microbatch))
                if a.stage not in grads:
                    grads[a.stage] = [None if o.dim() == 0 else _random_like(o, generator) for o in outs]
                torch.autograd.backward(list(outs), grads[a.stage])
            marks.append((a.stage, FORWARD if a.kind == FORWARD else BACKWARD, begin, watch.mark()))
        last = watch.mark()
        watch.wait()
        for stage, kind, b, e in marks:
            times.setdefault((stage, kind), []).append(watch.ms(b, e))
        result = ScheduleRun({s: statistics.median(v) for (s, k), v in times.items() if k == FORWARD},
                             {s: statistics.median(v) for (s, k), v in times.items() if k == BACKWARD},
                             watch.ms(first, last), gib(peak(device)), peak_in_flight(order))
    return result
