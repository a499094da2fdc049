"""The rank-slice benchmark's runs and reports (``scripts/bench/rank_slice.py`` is its command line): the
recipe and layout resolved as the trainer resolves them, the rank's stages built once, each part's entries
collected into one report (``rank_slice.json`` / ``.md``) and merged into the step-time table."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import subprocess
from pathlib import Path
from typing import Callable

import torch

from titan_kimi.config import load_job_config
from titan_kimi.data.causal_keys import longest_document
from titan_kimi.models.kimi_k3.layer_flops import ZERO
from titan_kimi.parallel.layout import resolve_layout
from titan_kimi.parallel.pipeline_images import unpad_images
from titan_kimi.parallel.rank_slice.build import build_head_alone, build_rank_slice, stages_of
from titan_kimi.parallel.rank_slice.expert_load import balanced_load, parse_load
from titan_kimi.parallel.rank_slice.measure import (ATTENTION, BLOCK, FFN, Entry, measure_blocks, measure_head,
                                                    measure_optimizer, measure_vision, run_schedule)
from titan_kimi.parallel.rank_slice.microbatch import RowLayout, make_microbatch
from titan_kimi.parallel.rank_slice.report import markdown_report
from titan_kimi.parallel.stage_params import compute_dtype
from titan_kimi.parallel.step_time.describe import settings_from_config
from titan_kimi.parallel.step_time.estimate import StepTimeModel
from titan_kimi.parallel.step_time.table import (PADDING_SKIPPED, Table, ac_share, geometry_key, measured_settings,
                                                 merge_entries)
from titan_kimi.training.setup.build import model_args_from_config, tokenizer_from_config, vision_args_from_config
from titan_kimi.training.setup.kernels import check_routed_expert_gemm, configure_kernels

PACKAGES = ("torch", "triton", "fla-core", "nvidia-cudnn-frontend", "torchtitan")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _noted(entries: list[Entry], note: str) -> list[Entry]:
    """``entries`` with ``note`` put before the note each already has."""
    for e in entries:
        e.note = note + (f"; {e.note}" if e.note else "")
    return entries


class RankSliceBench:
    def __init__(self, opts, overrides: list[str], log: Callable[[str], None]) -> None:
        self.opts, self.log = opts, log
        self.overrides = overrides
        argv = ["--job.config_file", str(opts.config), "--job.world_size", str(opts.world_size), *overrides]
        cfg = self.cfg = load_job_config(argv)
        args = self.args = model_args_from_config(cfg)
        t = cfg.training
        self.tokenizer = tokenizer_from_config(cfg, args)
        self.vision = vision_args_from_config(cfg, self.tokenizer)
        self.layout = resolve_layout(cfg, opts.world_size, args, image_text=self.vision is not None)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.resolved = configure_kernels(cfg.kernels, args)
        check_routed_expert_gemm(t.routed_expert_gemm, self.device)
        if opts.rows:
            cfg.step_time.rows = opts.rows  # the same forms; the step-time model checks it against seq_len
        self.model = StepTimeModel(cfg, args, self.vision, settings_from_config(cfg))
        self.rows_layout: RowLayout = self.model.rows_layout
        pipeline = self.layout.pipeline
        self.rows = self.layout.microbatch_size if pipeline is not None else t.local_batch_size
        self.n_microbatches = ((t.local_batch_size // self.rows if pipeline is not None else 1)
                               * self.layout.accumulation_steps)
        self.seq_len = self.model.row_len  # seq_len, or less where training.pad_to_multiple_of trims the padding
        self.tokens = self.rows * self.seq_len
        self.dtype = compute_dtype(cfg)
        self.gen = torch.Generator().manual_seed(cfg.job.seed)
        self.peak_flops = cfg.metrics.peak_flops
        self.loads = self._loads()
        self.work = self.model.works(self.layout, self.rows)
        self.stage = opts.stage if opts.stage >= 0 else max(self.work, key=lambda w: self.work[w].total.total)
        if self.stage not in self.work:
            raise ValueError(f"--stage {opts.stage}: valid 0..{len(self.work) - 1} (or -1, the busiest)")
        self.pp_rank = 0 if pipeline is None else next(r for r in range(pipeline.pp)
                                                       if self.stage in pipeline.stages_of_rank(r))
        self.report = self._meta()
        self.entries: list[Entry] = []
        self.log(f"{self.layout.describe()}; building pp rank {self.pp_rank} (stage {self.stage}"
                 f"{' = the busiest by model FLOPs' if opts.stage < 0 else ''}) on {self.device}")
        self.slice = build_rank_slice(cfg, args, self.layout, self.tokenizer, pp_rank=self.pp_rank,
                                      load=self.loads[0] if self.loads else None, device=self.device,
                                      max_layers=opts.max_layers)
        self.mbs = {index: make_microbatch(stage.part, self.rows_layout, self.rows, self.seq_len, self.device,
                                           self.dtype, self.gen) for index, stage in self.slice.stages}
        first = next(iter(self.mbs.values()))
        self.max_keys = None if pipeline is not None else longest_document(first.doc_ids.cpu())
        self.log(f"built: {self.slice.held_bytes / 2**30:.1f} GiB of weights and gradients; the rank holds "
                 f"{self.slice.state_bytes.total / 2**30:.1f} GiB for its parameters in training")

    # ------------------------------------------------------------------ set-up
    def _loads(self):
        if self.layout.ep == 1:
            return []
        a = self.args
        # every EP rank routes its real tokens' choices (padding tokens skip the routed experts)
        routed = max(1, round(self.tokens * self.model.real_fraction))
        return [parse_load(spec, routed, a.num_experts_per_tok, a.num_experts, self.layout.ep)
                for spec in self.opts.loads]

    def _meta(self) -> dict:
        cfg, layout = self.cfg, self.layout
        device = torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu"
        return {
            "meta": {
                "date": datetime.date.today().isoformat(), "commit": _commit(Path(__file__).resolve().parents[3]),
                "device": device, "versions": _versions(),
                "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if self.device.type == "cuda" else None,
                "config": cfg.job.config_file, "world_size": layout.world_size, "layout": layout.describe(),
                "flavor": cfg.model.flavor, "vision": cfg.model.vision_flavor, "dtype": str(self.dtype),
                "activation_checkpoint": (f"{cfg.activation_checkpoint.mode}/{cfg.activation_checkpoint.selective_ac_option}"
                                          + (f", the last {cfg.activation_checkpoint.uncheckpointed_blocks} blocks "
                                             "of a stage without" if cfg.activation_checkpoint.uncheckpointed_blocks
                                             else "")),
                "compile": f"{cfg.compile.mode}/{cfg.compile.granularity}", "kernels": {k: str(v) for k, v in self.resolved.items()},
                "rows": self.rows_layout.describe(), "microbatch": f"{self.rows} x {self.seq_len} tokens",
                "microbatches": self.n_microbatches, "loads": [l.describe() for l in self.loads],
                "stage": self.stage, "pp_rank": self.pp_rank, "peak_flops": self.peak_flops,
                "overrides": " ".join(self.overrides), "command": getattr(self.opts, "command", ""),
            },
            "stage_flops": {s: {"layers": len(w.layers), "forward": w.total.forward, "backward": w.total.backward}
                            for s, w in self.work.items()},
        }

    @property
    def kda_shape(self) -> tuple[int, int, int] | None:
        """(heads, head dim, tokens) of this run's KDA calls, if a built stage has a KDA layer."""
        a = self.args
        if not any(a.is_kda_layer(i) for part in self.slice.parts for i in map(int, part.layers)):
            return None
        return a.kda_num_heads, a.kda_head_dim, self.tokens

    # ------------------------------------------------------------------ parts
    def _measure(self, mbs=None, max_causal_keys=-1, **kw) -> list[Entry]:
        o = self.opts
        keys = self.max_keys if max_causal_keys == -1 else max_causal_keys
        return measure_blocks(self.slice, mbs or self.mbs, max_causal_keys=keys, warmup=o.warmup,
                              repeats=o.repeats, generator=self.gen, device=self.device, **kw)

    def run_layers(self) -> None:
        o = self.opts
        entries = self._measure()
        for load in self.loads[1:]:  # the MoE kinds again under the other loads
            self.slice.set_load(load)
            entries += self._measure(what=(BLOCK, FFN), select=lambda kind: "+moe" in kind)
        if self.loads:
            self.slice.set_load(self.loads[0])
        for index, stage in self.slice.stages:
            v = measure_vision(stage.part, self.mbs[index], warmup=o.warmup, repeats=o.repeats,
                               generator=self.gen, device=self.device)
            h = measure_head(stage.part, stage.loss_fn, self.mbs[index], warmup=o.warmup, repeats=o.repeats,
                             generator=self.gen, device=self.device, dtype=self.dtype)
            entries += [e for e in (v, h) if e is not None]
        if not any(e.kind == "head" for e in entries):  # this rank holds no head: build it alone
            index, stage = self.slice.stages[0]
            head = build_head_alone(self.cfg, self.args, self.tokenizer, self.device)
            entries.append(measure_head(head, stage.loss_fn, self.mbs[index], warmup=o.warmup, repeats=o.repeats,
                                        generator=self.gen, device=self.device, dtype=self.dtype,
                                        note="built alone (the last stage's norm and head; this rank holds none)"))
            del head
        moe = next((b for part in self.slice.parts for b in part.layers.values()
                    if getattr(getattr(b, "_checkpoint_wrapped_module", b), "moe_enabled", False)),
                   next(iter(self.slice.parts[0].layers.values())))
        entries.append(measure_optimizer(getattr(moe, "_checkpoint_wrapped_module", moe), self.cfg.optimizer,
                                         warmup=o.warmup, repeats=o.repeats, device=self.device))
        self._add("layers", entries)

    def run_dsa(self) -> None:
        if not self.args.has_indexer:
            self.report["dsa"] = "no indexer in this flavor"
            return
        entries = []
        for length in self.opts.dsa_rows:
            mbs = {i: make_microbatch(s.part, RowLayout("packed", documents=1), 1, length, self.device, self.dtype,
                                      self.gen) for i, s in self.slice.stages}
            found = self._measure(mbs, None, what=(ATTENTION,), select=lambda kind: kind.startswith("dsa"))
            entries += _noted(found, f"one {length}-token document per row")
        self._add("dsa", entries, "packed rows of one document")

    def run_table(self) -> None:
        entries = []
        for tokens in self.opts.table_tokens:
            rows = max(1, tokens // self.cfg.training.seq_len) if tokens >= self.cfg.training.seq_len else 1
            length = tokens // rows
            if self.loads:
                a = self.args
                self.slice.set_load(balanced_load(rows * length, a.num_experts_per_tok, a.num_experts, self.layout.ep))
            mbs = {i: make_microbatch(s.part, RowLayout("packed", documents=1), rows, length, self.device,
                                      self.dtype, self.gen) for i, s in self.slice.stages}
            found = self._measure(mbs, None, what=(BLOCK,))
            entries += _noted(found, f"{rows} row(s) of one {length}-token document")
        if self.loads:
            self.slice.set_load(self.loads[0])
        self._add("table", entries, "packed rows of one document")

    def run_gradients(self) -> None:
        """The block kinds twice, back to back: each backward adding its gradients into the ones held from the
        previous run (what the layers part times), then making them anew (what FSDP training does when it
        reduces every microbatch, or with one microbatch). Not entries of the step-time table: the difference is
        the add the table's entries hold."""
        held = _noted(self._measure(what=(BLOCK,)), "gradients added into held ones")
        new = _noted(self._measure(what=(BLOCK,), new_gradients=True), "gradients new each run (its peak holds them)")
        self._add("gradients", held + new, table=False)

    def run_profile(self) -> None:
        """Each layer kind (block, attention, FFN; the first load) under the profiler: DIR/profile.{md,json}."""
        from titan_kimi.parallel.rank_slice.kernel_profile import profile_job, profile_json, profile_markdown
        from titan_kimi.parallel.rank_slice.measure import block_jobs

        o = self.opts
        profiles = []
        for job in block_jobs(self.slice, self.mbs, max_causal_keys=self.max_keys, generator=self.gen,
                              device=self.device):
            profiles.append((job, profile_job(job, self.device, warmup=max(1, o.warmup), repeats=min(o.repeats, 3))))
            self.log(f"profiled {job.label}")
        o.out.mkdir(parents=True, exist_ok=True)
        (o.out / "profile.md").write_text(profile_markdown(profiles))
        (o.out / "profile.json").write_text(json.dumps(profile_json(profiles), indent=1) + "\n")
        self.report["profile"] = {"items": [job.label for job, _ in profiles], "file": "profile.md"}

    def run_gemm(self) -> None:
        """The expert GEMMs alone against their floor, under every load."""
        from titan_kimi.parallel.rank_slice.expert_gemms import measure_expert_gemms

        if not self.loads:
            self.report["gemm"] = "no expert parallelism: the experts are the model's own"
            return
        experts = next(getattr(b, "_checkpoint_wrapped_module", b).moe.experts for part in self.slice.parts
                       for b in part.layers.values() if getattr(getattr(b, "_checkpoint_wrapped_module", b),
                                                                 "moe_enabled", False))
        entries = []
        for load in self.loads:
            entries += measure_expert_gemms(experts, load, warmup=self.opts.warmup, repeats=self.opts.repeats,
                                            generator=self.gen, device=self.device)
        self._add("gemm", entries)

    def free_cached(self) -> None:
        """Gradients and cached blocks of a failed part go back to the device."""
        import gc

        for part in self.slice.parts:
            part.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Free the built stages (before another variant is built on the same device)."""
        import gc

        self.slice = self.mbs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()

    def run_stage(self) -> None:
        """The rank's schedule with what training holds beside the built weights allocated: the measured fit.
        When that runs out of memory, it is recorded and the schedule runs again without the buffer (for its
        times)."""
        fits = "yes"
        try:
            self.slice.allocate_states(self.device)
            run = self._schedule()
        except torch.OutOfMemoryError as err:
            self.slice.free_states()
            self.free_cached()
            fits = f"no: out of memory with {self.slice.missing_bytes / 2**30:.1f} GiB allocated beside ({str(err)[:300]})"
            self.log(f"schedule: {fits}; timing it again without the buffer")
            run = self._schedule()
        finally:
            self.slice.free_states()
        self._report_schedule(run, fits)

    def _built_flops(self, index: int):
        """Model FLOPs of what was built of stage ``index``: every layer but the dropped ones (``--max-layers``),
        the tower, and the head only when the stage's last layer was built."""
        w = self.work[index]
        dropped = set(self.slice.dropped.get(index, ()))
        out = w.vision + (ZERO if dropped else w.head)
        for layer, _, f in w.layers:
            if layer not in dropped:
                out = out + f
        return out

    def _schedule(self):
        return run_schedule(self.slice, self.mbs, self.layout.pipeline, self.pp_rank, self.n_microbatches,
                            steps=self.opts.steps, generator=self.gen, device=self.device, forward=self._forward)

    def _report_schedule(self, run, fits: str) -> None:
        flops = {i: self._built_flops(i) for i, _ in self.slice.stages}
        built = {i: len(s.part.layers) for i, s in self.slice.stages}
        self.report["schedule"] = {
            "forward_ms": run.forward_ms, "backward_ms": run.backward_ms, "step_ms": run.step_ms,
            "peak_gib": run.peak_gib, "in_flight": run.in_flight, "built_layers": built,
            "dropped_layers": self.slice.dropped,
            "allocated_states_gib": self.slice.missing_bytes / 2**30, "fits": fits,
            "model_flops": {i: {"forward": f.forward, "backward": f.backward} for i, f in flops.items()},
        }
        self.log(f"schedule: step {run.step_ms:.0f} ms, peak {run.peak_gib} GiB, F {run.forward_ms} B {run.backward_ms}")

    def _forward(self, index: int, mb, normalizer: float) -> tuple:
        stage = dict(self.slice.stages)[index]
        part = stage.part
        if self.layout.pipeline is None and part.is_last:
            # the trainer without a pipeline: the model with the batch's longest document, then the loss
            images = dict(zip(("pixel_values", "grid_thws"), unpad_images(*mb.inputs[1:]))) if len(mb.inputs) == 3 else {}
            hidden = part(mb.inputs[0], doc_ids=mb.doc_ids, return_hidden=True, max_causal_keys=self.max_keys,
                          **images)
            return (stage.loss_fn(part.output, hidden, mb.labels, normalizer),)
        out = stage(*mb.inputs, doc_ids=mb.doc_ids, labels=mb.labels, normalizer=normalizer)
        return out if isinstance(out, tuple) else (out,)

    # ------------------------------------------------------------------ output
    def _add(self, part: str, entries: list[Entry], rows: str = "", table: bool = True) -> None:
        """``entries`` into the report under ``part``, and (``table``) into the step-time table's candidates."""
        for e in entries:
            e.rows = rows or self.rows_layout.describe()
        if table:
            self.entries += entries
        self.report[part] = [e.row(self.peak_flops) for e in entries]
        for e in entries:
            self.log(f"{e.name}: fwd {e.forward_ms:.2f} ms, bwd {e.backward_ms:.2f} ms ({e.tokens} tokens)")

    def write(self, table: bool = True) -> None:
        out: Path = self.opts.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank_slice.json").write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        (out / "rank_slice.md").write_text(markdown_report(self.report))
        if table:
            self._write_table()

    def _write_table(self) -> None:
        path = self.opts.table or self.opts.out / "step_time_h200.json"
        table = Table.load(path).data
        geometry = geometry_key(self.args)
        hardware = self.report["meta"]["device"]
        ac = ac_share(self.cfg.activation_checkpoint.mode, self.cfg.activation_checkpoint.selective_ac_option)
        stamp = {k: self.report["meta"][k] for k in ("date", "commit", "config")}
        changed = False
        for e in self.entries:
            section = {"block": "layers", "vision": "vision", "head": "head"}.get(e.kind)
            if section is None:
                continue
            settings = measured_settings(self.cfg)
            if e.kind == "block" and not e.checkpointed:  # a block the config leaves out of checkpointing
                settings["checkpointing"] = "none"
            record = {"tokens": e.tokens, "rows": e.rows,
                      "ac": ac if e.checkpointed else 0.0, "load": e.load or "balanced", "padding": PADDING_SKIPPED,
                      # only decoder layers are checkpointed: the others' entries hold no checkpointing
                      **{k: v for k, v in settings.items() if e.kind == "block" or k != "checkpointing"},
                      "forward_ms": e.forward_ms, "backward_ms": e.backward_ms, "forward_flops": e.flops.forward,
                      "backward_flops": e.flops.backward, "saved_gib": e.saved_gib, "peak_gib": e.peak_gib, **stamp}
            if e.load:  # a MoE layer: how many routed experts its rows were spread over, by which dispatch
                record["local_experts"] = self.args.num_experts // self.layout.ep
                record["dispatch"] = self.layout.ep_dispatch
            table = merge_entries(table, geometry, section, e.name if e.kind == "block" else e.kind, record,
                                  hardware=hardware, peak_flops=self.peak_flops)
            changed = True
        opt = next((e for e in self.entries if e.kind == "optimizer"), None)
        if opt is not None and table is not None:
            key = f"{self.cfg.optimizer.implementation}/{self.cfg.optimizer.state_dtype}/{self.dtype}"
            table.setdefault("optimizer_ns_per_param", {})[key] = opt.forward_ms * 1e6 / opt.tokens
        if changed:
            runs = table.setdefault("runs", [])
            run = {**stamp, "device": hardware, "versions": self.report["meta"]["versions"],
                   "command": self.report["meta"].get("command", "")}
            if run not in runs:
                runs.append(run)
            Path(path).write_text(json.dumps(table, indent=1) + "\n")
