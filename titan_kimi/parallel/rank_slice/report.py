"""The rank-slice benchmark's markdown report: the set-up, the per-layer table (forward / backward ms, model
FLOPs, TFLOP/s, MFU, memory), the per-stage model FLOPs and the rank's schedule run."""

from __future__ import annotations


def _num(x, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def _entries(rows: list[dict]) -> list[str]:
    # host ms: the Python thread's time to queue the phase; at or above its device ms the phase is host-bound
    out = ["| item | tokens | fwd ms | bwd ms | host fwd / bwd ms | fwd GFLOP | bwd GFLOP | fwd TFLOP/s | bwd TFLOP/s "
           "| MFU | saved GiB | peak GiB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["flops"]
        backward = f["backward_input"] + f["backward_weight"]
        mfu = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        host = f"{_num(r.get('host_forward_ms'))} / {_num(r.get('host_backward_ms'))}"
        out.append(f"| {r['name']} | {r['tokens']} | {_num(r['forward_ms'])} | {_num(r['backward_ms'])} | {host} | "
                   f"{f['forward'] / 1e9:.4g} | {backward / 1e9:.4g} | {_num(r['forward_tflops'], '.0f')} | "
                   f"{_num(r['backward_tflops'], '.0f')} | {mfu} | {_num(r['saved_gib'])} | {_num(r['peak_gib'])} | "
                   f"{r['note']} |")
    return out


def markdown_report(report: dict) -> str:
    m = report["meta"]
    lines = [f"# Rank slice: {m['config']} at {m['world_size']} GPUs, stage {m['stage']} (pp rank {m['pp_rank']})", "",
             f"{m['date']}, commit {m['commit']}, {m['device']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, "
             + ", ".join(f"{k} {v}" for k, v in m["versions"].items()), "",
             f"- layout: {m['layout']}",
             f"- model: {m['flavor']}{' + ' + m['vision'] if m['vision'] else ''}, {m['dtype']}, activation "
             f"checkpointing {m['activation_checkpoint']}, compile {m['compile']}",
             f"- kernels: {', '.join(f'{k}={v}' for k, v in m['kernels'].items())}",
             f"- microbatch: {m['microbatch']} ({m['rows']}), {m['microbatches']} per step",
             f"- expert loads: {'; '.join(m['loads']) or 'no expert parallelism: every expert is local'}",
             f"- MFU on a {m['peak_flops'] / 1e12:.0f} TFLOP/s basis, model FLOPs (a backward under activation "
             "checkpointing also recomputes the forward: executed, not counted)", ""]
    if "tune_fla" in report:
        lines += [f"FLA tuning: {report['tune_fla']}", ""]
    for part, value in report.items():
        if isinstance(value, dict) and "error" in value:
            lines += [f"**part {part} failed**: {value['error']}", ""]
    for part, title in (("layers", "Per layer kind (the recipe's microbatch)"), ("dsa", "DSA attention on long rows"),
                        ("gradients", "Block kinds with their gradients added into held ones, then made anew"),
                        ("gemm", "The routed experts' GEMMs against their floor"),
                        ("table", "Block kinds at other microbatch sizes")):
        if isinstance(report.get(part), list):
            lines += [f"## {title}", "", *_entries(report[part]), ""]
    lines += ["## Model FLOPs per stage (one microbatch)", "", "| stage | layers | fwd TFLOP | bwd TFLOP |",
              "|---|---|---|---|"]
    for s, w in report["stage_flops"].items():
        lines.append(f"| {s} | {w['layers']} | {w['forward'] / 1e12:.2f} | {w['backward'] / 1e12:.2f} |")
    sched = report.get("schedule")
    if sched:
        lines += ["", "## The rank's schedule (no communication)", ""]
        for s in sched["forward_ms"]:
            f = sched["model_flops"].get(s) or sched["model_flops"].get(str(s))
            per = sched["forward_ms"][s] + sched["backward_ms"][s]
            mfu = f["forward"] + f["backward"]
            lines.append(f"- stage {s}: forward {sched['forward_ms'][s]:.1f} ms, backward "
                         f"{sched['backward_ms'][s]:.1f} ms per microbatch ({sched['built_layers'][s]} layers built); "
                         f"compute MFU {100 * mfu / (per / 1e3) / m['peak_flops']:.1f}% of "
                         + ("the built layers' FLOPs (the stage's other layers were not built)"
                            if sched["dropped_layers"].get(s) or sched["dropped_layers"].get(str(s))
                            else "its full stage's FLOPs"))
        lines += [f"- step span {sched['step_ms']:.0f} ms; microbatches in flight {sched['in_flight']}",
                  f"- peak memory {_num(sched['peak_gib'])} GiB, with {sched['allocated_states_gib']:.1f} GiB allocated "
                  "beside the built weights for what training holds besides them (FSDP shards, Adam moments, the "
                  "fp32 accumulated gradients, layers not built); fits: " + sched.get("fits", "?")]
    return "\n".join(lines) + "\n"


def variants_report(reports: dict[str, dict]) -> str:
    """A/B of the variants' per-layer entries: forward + backward ms of each item, and its speed-up over the
    first variant."""
    names = list(reports)
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for variant, report in reports.items():
        for part in ("layers", "gemm"):
            for r in report.get(part, []) if isinstance(report.get(part), list) else []:
                rows.setdefault((r["name"], r.get("load", "")), {})[variant] = r["forward_ms"] + r["backward_ms"]
    lines = ["# Variants: forward + backward ms per item (speed-up over the first)", "",
             *(f"- {n}: {reports[n]['meta'].get('variant') or 'no overrides'}" for n in names), "",
             "| item | load | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for (item, load), times in rows.items():
        base = times.get(names[0])
        cells = []
        for n in names:
            t = times.get(n)
            cells.append("—" if t is None else f"{t:.2f}" + (f" ({base / t:.2f}x)" if base and n != names[0] else ""))
        lines.append(f"| {item} | {load} | " + " | ".join(cells) + " |")
    for n in names:
        sched = reports[n].get("schedule")
        if sched:
            lines.append(f"\n{n}: schedule step {sched['step_ms']:.0f} ms, peak {_num(sched['peak_gib'])} GiB")
    return "\n".join(lines) + "\n"
