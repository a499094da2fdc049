"""K3.1 indexer training end to end on one GPU: warm-up, sparse stage, throughput. `python scripts/check/indexer_training.py --out DIR [--part learning|throughput|all] [--tiny]`

--part learning (one H200, ~4-5 min at the defaults): on long documents built from the bundled sample text (each
one a seeded draw, with replacement, of the sample's records until it holds --doc-tokens tokens; packed into
--seq-len rows, so most queries have more causal keys than top-2,048):
  1. a K3 model (k3_small: the K3.1 geometry without an indexer) trains densely for --dense-steps, so that its
     attention is no longer near-uniform;
  2. it is given a freshly initialised indexer (model.add_indexer) and warmed up (indexer.mode = warmup, the
     indexer alone trains) for --warmup-steps: the KL and the recall (the share of the main attention's mass
     inside the indexer's top-k, over queries with more causal keys than top-k) per logged step; then, on one
     batch, per DSA layer: the best recall any shared top-k can reach (the head-summed attention's own top-k
     mass: the target's concentration) beside the indexer's;
  3. the sparse stage (indexer.mode = sparse) and a dense control (the K3 model continuing, the same data and
     weights) run --sparse-steps each: the LM losses side by side, and the recall.
--part throughput (~4 min: three reduce-overhead compiles): k31_small at 8,192-token rows as shipped, frozen /
  warmup / sparse, median tokens/s over the steps after compile (logging steps, which measure the recall,
  apart).
Writes DIR/indexer_training.json (after every stage, so a run stopped by its time limit keeps what it measured),
DIR/indexer_training.md and the runs' metrics.jsonl under DIR/runs/. --tiny: the debug flavors at 128-token rows
(CPU, a few steps: checks the script itself).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from titan_kimi.config import load_job_config  # noqa: E402
from titan_kimi.data import TOKENIZER_DIR, KimiTokenizer  # noqa: E402
from titan_kimi.data.assets import SAMPLE_TEXT_PATH  # noqa: E402
from titan_kimi.models.kimi_k3.mla import GatedMLA  # noqa: E402
from titan_kimi.training.process.distributed import DistEnv  # noqa: E402
from titan_kimi.parallel.layout import resolve_layout  # noqa: E402
from titan_kimi.trainer import Trainer  # noqa: E402
from titan_kimi.training.setup.build import model_args_from_config  # noqa: E402
from titan_kimi.training.setup.kernels import configure_kernels, import_backend_libraries  # noqa: E402


def long_documents(path: Path, *, documents: int, doc_tokens: int, seed: int) -> dict:
    """A jsonl of ``documents`` documents, each the bundled sample's records drawn with replacement (seeded)
    until it holds ``doc_tokens`` tokens of the bundled tokenizer (the trainer's default)."""
    records = [json.loads(line)["text"] for line in SAMPLE_TEXT_PATH.read_text().splitlines()]
    tokenizer = KimiTokenizer(TOKENIZER_DIR)
    lengths = [len(tokenizer.encode(r)) + 1 for r in records]
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with path.open("w") as f:
        for _ in range(documents):
            parts, tokens = [], 0
            while tokens < doc_tokens:
                i = rng.randrange(len(records))
                parts.append(records[i])
                tokens += lengths[i]
            total += tokens
            f.write(json.dumps({"text": "\n".join(parts)}) + "\n")
    return {"documents": documents, "tokens_per_document": doc_tokens, "tokens": total,
            "source_records": len(records), "path": str(path)}


def trainer(argv: list[str]) -> Trainer:
    cfg = load_job_config(argv, environ={})
    args = model_args_from_config(cfg)
    resolved = configure_kernels(cfg.kernels, args)
    if resolved["kda"] == "fla":
        from lowerings.kernels.fla_kda import prepare_fla_configs

        prepare_fla_configs()
    import_backend_libraries(resolved)
    layout = resolve_layout(cfg, 1, args)
    return Trainer(cfg, args, layout, DistEnv(0, 1, 0))


def run(t: Trainer) -> list[dict]:
    t.train()
    t.close()
    return [m.as_dict() for m in t.metrics.history]


def release() -> None:
    """Free the device memory of the trainers dropped so far (the train loop leaves the collector off)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_weights(t: Trainer, state: dict[str, torch.Tensor]) -> list[str]:
    """Copy ``state`` into the trainer's model; returns the model keys it lacked (a K3 state: the indexer)."""
    missing, unexpected = t.model.load_state_dict(state, strict=False)
    if unexpected or any(".indexer." not in k for k in missing):
        raise RuntimeError(f"weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return missing


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@torch.no_grad()
def concentration(t: Trainer, topk: int, queries: int) -> list[dict]:
    """Per DSA layer, on the last ``queries`` queries of the first row of one batch: the mass of the head-summed
    dense attention inside its own top-k (the best recall of any shared selection) and inside the indexer's."""
    captured: dict[str, tuple] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, name=n: captured.__setitem__(name, a))
             for n, m in t.model.named_modules() if isinstance(m, GatedMLA) and m.indexer is not None]
    batch = {k: v.to(t.device) for k, v in next(iter(t.dataloader)).items()}
    with torch.autocast(t.device.type, dtype=t.autocast_dtype, enabled=t.autocast_dtype is not None):
        t.model(batch["input_ids"], doc_ids=batch["doc_ids"], return_hidden=True)
    for h in hooks:
        h.remove()
    modules = dict(t.model.named_modules())
    out = []
    for name, (x, seq) in captured.items():
        mla = modules[name]
        B, S, _ = x.shape
        q, q_latent = mla._queries(x)
        q_lat = mla.latent_queries(q.view(B, S, mla.n_heads, mla.qk_dim)).float()
        c_kv, k_rope = mla.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope], dim=-1)
        kv = torch.cat([mla.kv_a_layernorm(c_kv), k_rope], dim=-1).view(B * S, -1).float()
        rows = torch.arange(S - queries, S, device=x.device)  # row 0's last queries
        seg = seq.flat_seg_start[rows].long()
        keys = torch.arange(S, device=x.device)
        allowed = (keys[None, :] <= rows[:, None]) & (keys[None, :] >= seg[:, None])
        logits = torch.einsum("thd,sd->ths", q_lat[rows], kv[:S]) * mla.scale
        p = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), -1).mean(1)  # [R, S]
        counted = allowed.sum(-1) > topk
        best = p.topk(topk, dim=-1).values.sum(-1)
        idx = mla.indexer(x, q_latent, seq)[rows].long()
        chosen = torch.where(idx >= 0, p.gather(1, idx.clamp(min=0)), torch.zeros_like(p[:, :1]))
        got = chosen.sum(-1)
        out.append({"layer": name, "queries": int(counted.sum()),
                    "best_recall": float(best[counted].mean()) if counted.any() else None,
                    "indexer_recall": float(got[counted].mean()) if counted.any() else None})
    return out


def logged(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(m["step"], m[key]) for m in history if m.get(key) is not None]


class Report:
    def __init__(self, out: Path, opts) -> None:
        self.out, self.data = out, {"environment": environment(), "options": vars(opts)}
        out.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        (self.out / "indexer_training.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "indexer_training.md").write_text(markdown(self.data))


def environment() -> dict:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": gpu, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "python": platform.python_version(),
            "command": " ".join(sys.argv)}


def markdown(d: dict) -> str:
    env = d["environment"]
    lines = [f"# Indexer training check ({env['date']}, commit {env['commit']}, {env['device']}, torch {env['torch']}, "
             f"triton {env['triton']})", "", f"`{env['command']}`", ""]
    if "warmup" in d:
        w = d["warmup"]
        lines += ["## Warm-up (indexer alone, dense attention)", "",
                  f"KL: {w['kl_first']:.4g} -> {w['kl_last']:.4g}; recall: {w['recall_first']:.3f} -> "
                  f"{w['recall_last']:.3f} over {w['steps']} steps ({w['seconds']:.0f} s)", "",
                  "| layer | queries | best recall (target's own top-k) | indexer recall |", "|---|---|---|---|"]
        lines += [f"| {c['layer']} | {c['queries']} | {c['best_recall']:.3f} | {c['indexer_recall']:.3f} |"
                  for c in w["concentration"] if c["best_recall"] is not None]
        lines.append("")
    if "sparse" in d:
        s = d["sparse"]
        lines += ["## Sparse stage against the dense model", "",
                  f"mean |loss difference| {s['mean_abs_loss_diff']:.4f} ({100 * s['mean_rel_loss_diff']:.2f}% of the "
                  f"dense loss; tolerance {100 * s['tolerance']:.0f}%: {'within' if s['within_tolerance'] else 'OUTSIDE'}); "
                  f"final losses sparse {s['sparse_loss_last']:.4f} / dense {s['dense_loss_last']:.4f}; recall mean "
                  f"{s['recall_mean']:.3f} (warm-up end {s['recall_warmup_end']:.3f})", ""]
    if "throughput" in d:
        lines += ["## Throughput (tokens/s, median after compile)", "", "| mode | all steps | non-logging steps | "
                  "vs frozen | logging steps |", "|---|---|---|---|---|"]
        base = d["throughput"].get("frozen", {}).get("median_tokens_per_sec_plain")
        for mode, r in d["throughput"].items():
            ratio = f"{r['median_tokens_per_sec_plain'] / base:.3f}" if base else "-"
            lines.append(f"| {mode} | {r['median_tokens_per_sec']:.0f} | {r['median_tokens_per_sec_plain']:.0f} | "
                         f"{ratio} | {r['median_tokens_per_sec_logged']:.0f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def learning(opts, report: Report, data: Path) -> None:
    small = opts.tiny is False
    k3 = "k3_small" if small else "k3_debug"
    topk = 2048 if small else 32
    common = ["--model.flavor", k3, "--training.seq_len", str(opts.seq_len), "--training.local_batch_size",
              str(opts.batch), "--data.path", str(data), "--metrics.save_jsonl", "true", "--job.seed", "7",
              "--compile.mode", "none", "--lr_scheduler.decay_type", "constant"]
    if small:
        common += ["--model.dtype", "bfloat16", "--training.param_dtype", "bfloat16", "--optimizer.state_dtype",
                   "bfloat16", "--optimizer.implementation", "fused"]
    runs = report.out / "runs"

    t0 = time.perf_counter()
    dense = trainer([*common, "--training.steps", str(opts.dense_steps), "--optimizer.lr", "6e-4",
                     "--lr_scheduler.warmup_steps", str(min(10, opts.dense_steps // 2)), "--metrics.log_freq", "10",
                     "--job.dump_folder", str(runs / "dense_pretraining")])
    history = run(dense)
    state = weights(dense)
    del dense
    release()
    report.put("dense_pretraining", {"steps": opts.dense_steps, "loss_first": history[0]["loss"],
                                     "loss_last": history[-1]["loss"], "seconds": time.perf_counter() - t0})

    t0 = time.perf_counter()
    warm = trainer([*common, "--model.add_indexer", "true", "--indexer.mode", "warmup", "--training.steps",
                    str(opts.warmup_steps), "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", str(min(5, opts.warmup_steps // 2)),
                    "--metrics.log_freq", str(opts.log_freq), "--job.dump_folder", str(runs / "warmup")])
    fresh = load_weights(warm, state)
    history = run(warm)
    kl, recall = logged(history, "indexer_kl"), logged(history, "indexer_recall")
    warm_state = weights(warm)
    report.put("warmup", {"steps": opts.warmup_steps, "fresh_indexer_tensors": len(fresh), "kl": kl, "recall": recall,
                          "kl_first": kl[0][1], "kl_last": kl[-1][1], "recall_first": recall[0][1],
                          "recall_last": recall[-1][1], "seconds": time.perf_counter() - t0,
                          "concentration": concentration(warm, topk, min(512, opts.seq_len // 4))})
    del warm
    release()

    t0 = time.perf_counter()
    stage = ["--training.steps", str(opts.sparse_steps), "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "0",
             "--metrics.log_freq", str(opts.log_freq)]
    sparse = trainer([*common, *stage, "--model.add_indexer", "true", "--indexer.mode", "sparse",
                      "--job.dump_folder", str(runs / "sparse")])
    load_weights(sparse, warm_state)
    sparse_history = run(sparse)
    del sparse
    release()
    control = trainer([*common, *stage, "--job.dump_folder", str(runs / "dense_control")])
    load_weights(control, {k: v for k, v in warm_state.items() if ".indexer." not in k})
    dense_history = run(control)
    del control
    release()
    a, b = [m["loss"] for m in sparse_history], [m["loss"] for m in dense_history]
    diff = statistics.mean(abs(x - y) for x, y in zip(a, b))
    rel = diff / statistics.mean(b)
    recalls = [r for _, r in logged(sparse_history, "indexer_recall")]
    report.put("sparse", {"steps": opts.sparse_steps, "sparse_loss": a, "dense_loss": b, "mean_abs_loss_diff": diff,
                          "mean_rel_loss_diff": rel, "tolerance": opts.loss_tolerance,
                          "within_tolerance": rel <= opts.loss_tolerance, "sparse_loss_last": a[-1],
                          "dense_loss_last": b[-1], "recall": logged(sparse_history, "indexer_recall"),
                          "recall_mean": statistics.mean(recalls), "recall_warmup_end": recall[-1][1],
                          "kl": logged(sparse_history, "indexer_kl"), "seconds": time.perf_counter() - t0})


def throughput(opts, report: Report, data: Path) -> None:
    small = opts.tiny is False
    results = {}
    for mode in opts.modes:
        argv = ["--job.config_file", "train_configs/k31_small.toml" if small else "train_configs/k31_debug.toml",
                "--training.seq_len", str(opts.throughput_seq_len), "--data.path", str(data),
                "--training.steps", str(opts.throughput_steps), "--metrics.log_freq", "10", "--indexer.mode", mode,
                "--job.dump_folder", str(report.out / "runs" / f"throughput_{mode}")]
        if not small:
            argv += ["--training.local_batch_size", "2"]
        if opts.profile_step:
            argv += ["--profiling.enable", "true", "--profiling.steps", str(opts.profile_step)]
        # after the compile steps; a profiled step runs slower and stays out of the medians
        history = [m for m in run(trainer(argv))[3:] if m["step"] != opts.profile_step]
        release()
        plain = [m["tokens_per_sec"] for m in history if m.get("indexer_kl") is None]
        with_log = [m["tokens_per_sec"] for m in history if m.get("indexer_kl") is not None]
        results[mode] = {"median_tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in history),
                         "median_tokens_per_sec_plain": statistics.median(plain or [m["tokens_per_sec"]
                                                                                    for m in history]),
                         "median_tokens_per_sec_logged": statistics.median(with_log) if with_log else float("nan"),
                         "peak_mem_gib": max(m["peak_mem_gib"] for m in history), "steps": len(history)}
        report.put("throughput", results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the results and the runs' metrics")
    parser.add_argument("--part", choices=("learning", "throughput", "all"), default="learning")
    parser.add_argument("--tiny", action="store_true", help="debug flavors at 128-token rows (CPU: the script)")
    parser.add_argument("--seq-len", type=int, default=None, help="learning rows (default 4096; --tiny 128)")
    parser.add_argument("--batch", type=int, default=2, help="rows per step in the learning part")
    parser.add_argument("--doc-tokens", type=int, default=None, help="tokens per document (default 6000; tiny 200)")
    parser.add_argument("--documents", type=int, default=None, help="documents (default 240; tiny 40)")
    parser.add_argument("--dense-steps", type=int, default=150)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--sparse-steps", type=int, default=60)
    parser.add_argument("--log-freq", type=int, default=5, help="logged (recall-measuring) steps of warm-up/sparse")
    parser.add_argument("--loss-tolerance", type=float, default=0.02,
                        help="mean |sparse - dense| LM loss over the sparse stage, as a share of the dense loss")
    parser.add_argument("--throughput-steps", type=int, default=25)
    parser.add_argument("--throughput-seq-len", type=int, default=None, help="default 8192; tiny 128")
    parser.add_argument("--modes", nargs="+", choices=("frozen", "warmup", "sparse"),
                        default=["frozen", "warmup", "sparse"], help="the throughput part's indexer modes")
    parser.add_argument("--profile-step", type=int, default=0,
                        help="throughput part: profile this step of each mode (torch.profiler; 0 = none)")
    opts = parser.parse_args()
    if opts.profile_step < 0 or opts.profile_step > opts.throughput_steps:
        parser.error(f"--profile-step {opts.profile_step}: a step of the throughput runs, 1..{opts.throughput_steps}, "
                     "or 0 for none")
    opts.seq_len = opts.seq_len or (128 if opts.tiny else 4096)
    opts.throughput_seq_len = opts.throughput_seq_len or (128 if opts.tiny else 8192)
    opts.doc_tokens = opts.doc_tokens or (200 if opts.tiny else 6000)
    opts.documents = opts.documents or (40 if opts.tiny else 240)
    report = Report(opts.out, opts)
    data = opts.out / "data" / "long_documents.jsonl"
    report.put("data", long_documents(data, documents=opts.documents, doc_tokens=opts.doc_tokens, seed=11))
    if opts.part in ("learning", "all"):
        learning(opts, report, data)
    if opts.part in ("throughput", "all"):
        throughput(opts, report, data)
    print((opts.out / "indexer_training.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
