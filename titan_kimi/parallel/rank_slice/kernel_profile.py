"""Where a layer kind's time goes: torch's profiler over its forward and its backward (separately), the device
kernels grouped into what they are (GEMMs, FLA's KDA kernels, our Triton kernels, Inductor's fused kernels,
eager elementwise and memory kernels, ...) and the device's idle time beside them (launch-bound gaps). On a
CPU the same report reads the operators' own CPU time."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from titan_kimi.parallel.rank_slice.measure import BlockJob
from titan_kimi.parallel.rank_slice.timing import Stopwatch, synchronize

# First match wins: the order puts the specific names before the generic ones.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = tuple((name, re.compile(pattern, re.I)) for name, pattern in (
    ("kda (fla)", r"chunk_|kda|gated_delta|wy_fast|recompute_w_u|solve_tril|merge_16x16|fwd_h|bwd_dh|bwd_dv|"
                  r"l2norm|fused_recurrent|prepare_wy"),
    ("sparse mla / indexer (triton)", r"sparse_mla|indexer|_topk_|topk_select|^_bwd_dq_kernel|^_bwd_dkv_kernel"),
    ("fused kernels (ours)", r"situ|attn_res|swiglu|linear_cross|liger|gather_sum|short_conv"),
    ("attention (flash / cudnn)", r"flash|fmha|sdpa|cudnn|attention"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm100_|_mm_|bmm|matmul|triton_tem|::mm$|addmm|grouped_mm"),
    ("inductor fused", r"^triton_(poi|red|per)_"),
    ("memory (copy, cat, gather, scatter, fill)", r"copy|memcpy|memset|cat|gather|scatter|index|fill|put_|"
                                                  r"take_along|flip|roll|where|masked"),
    ("sort, top-k, cumsum, histogram", r"sort|topk|radix|cumsum|scan|histc|bincount|unique|argmax|max_|min_"),
    ("eager elementwise / reduce", r"elementwise|vectorized|reduce|unrolled|softmax|norm|pow|mul|add|exp|sigmoid"),
))


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel):
            return name
    return "other"


@dataclass
class PhaseProfile:
    """One phase (forward or backward) of one item: wall ms, per-kernel (ms, launches) per repetition."""

    wall_ms: float = 0.0
    kernels: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))

    @property
    def busy_ms(self) -> float:
        return sum(ms for ms, _ in self.kernels.values())

    def categories(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for name, (ms, _) in self.kernels.items():
            out[category(name)] += ms
        return dict(out)


def _collect(prof, cuda: bool, repeats: int, into: PhaseProfile) -> None:
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                slot = into.kernels[e.name]
                slot[0] += e.time_range.elapsed_us() / 1e3 / repeats
                slot[1] += 1 / repeats
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                slot = into.kernels[e.key]
                slot[0] += e.self_cpu_time_total / 1e3 / repeats
                slot[1] += e.count / repeats


def _profiled(fn, device: torch.device, repeats: int, into: PhaseProfile):
    """``fn()`` under the profiler (the device idle before and after), its wall time and kernels added to
    ``into`` as one of ``repeats`` repetitions; returns what ``fn`` returns."""
    cuda = device.type == "cuda"
    synchronize(device)
    watch = Stopwatch(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        a = watch.mark()
        out = fn()
        b = watch.mark()
        synchronize(device)
    into.wall_ms += watch.ms(a, b) / repeats
    _collect(prof, cuda, repeats, into)
    return out


def profile_job(job: BlockJob, device: torch.device, warmup: int, repeats: int) -> dict[str, PhaseProfile]:
    """The item's forward and its backward, each profiled on its own (the other phase runs unprofiled),
    ``repeats`` times after ``warmup`` unprofiled runs."""
    forward, backward = PhaseProfile(), PhaseProfile()

    def run_backward(outs, grads):
        if any(o.requires_grad for o in outs):
            torch.autograd.backward(outs, grads)

    for _ in range(warmup):
        run_backward(*job.run())
    for _ in range(repeats):
        run_backward(*_profiled(job.run, device, repeats, forward))
        outs, grads = job.run()
        _profiled(lambda: run_backward(outs, grads), device, repeats, backward)
    return {"forward": forward, "backward": backward}


def profile_markdown(profiles: list[tuple[BlockJob, dict[str, PhaseProfile]]], top: int = 15) -> str:
    """Per item: the categories' ms per phase with their share, the device's idle time, the top kernels."""
    lines = ["# Where each layer kind's time goes (profiler, per repetition)", "",
             "Device kernel time by category, forward and backward apart (a backward under activation "
             "checkpointing includes the recomputed forward); `idle` is the phase's wall time the device spent "
             "without a kernel (launch-bound gaps, host work).", ""]
    for job, phases in profiles:
        fwd, bwd = phases["forward"], phases["backward"]
        lines += [f"## {job.label}" + (f" ({job.note})" if job.note else ""), "",
                  f"wall: forward {fwd.wall_ms:.2f} ms, backward {bwd.wall_ms:.2f} ms; kernels: forward "
                  f"{fwd.busy_ms:.2f} ms, backward {bwd.busy_ms:.2f} ms", "",
                  "| category | fwd ms | bwd ms | share of fwd + bwd wall |", "|---|---|---|---|"]
        cf, cb = fwd.categories(), bwd.categories()
        wall = fwd.wall_ms + bwd.wall_ms
        rows = {c: (cf.get(c, 0.0), cb.get(c, 0.0)) for c in {*cf, *cb}}
        rows["idle"] = (max(0.0, fwd.wall_ms - fwd.busy_ms), max(0.0, bwd.wall_ms - bwd.busy_ms))
        for c, (f, b) in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"| {c} | {f:.2f} | {b:.2f} | {100 * (f + b) / wall:.1f}% |" if wall else
                         f"| {c} | {f:.2f} | {b:.2f} | — |")
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for phase, i in (("forward", 0), ("backward", 1)):
            for name, (ms, n) in phases[phase].kernels.items():
                kernels[name][i] += ms
                kernels[name][2] += n
        lines += ["", f"top {top} kernels:", "", "| kernel | category | fwd ms | bwd ms | launches |",
                  "|---|---|---|---|---|"]
        for name, (f, b, n) in sorted(kernels.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
            short = name if len(name) <= 110 else name[:107] + "..."
            lines.append(f"| `{short.replace('|', '/')}` | {category(name)} | {f:.3f} | {b:.3f} | {n:.0f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def profile_json(profiles: list[tuple[BlockJob, dict[str, PhaseProfile]]]) -> list[dict]:
    return [{"name": job.label, "note": job.note,
             **{phase: {"wall_ms": p.wall_ms, "busy_ms": p.busy_ms, "categories": p.categories(),
                        "kernels": {k: {"ms": ms, "launches": n} for k, (ms, n) in p.kernels.items()}}
                for phase, p in phases.items()}} for job, phases in profiles]
