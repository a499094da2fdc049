"""The compiled step against eager on the same weights every step: python scripts/check/compile_numerics.py --config train_configs/k3_small.toml --out FILE.json

How far the compiled step is from eager, next to how far two exact eager kernels are from each other: compile
error apart from the run-to-run spread of whole loss curves.

Loss curves of separate runs drift apart at the recipes' learning rate (bf16, the loss jumps at steps 7 and
11-12), so two runs of one tree from empty caches already differ by as much as the tolerance the curves are
judged by (docs/perf.md). Here one trainer, built as the recipe builds it, computes each step three times on
the weights it has at that step:

- ``compiled``: the step as the recipe compiles it;
- ``eager``: the same modules under ``torch.compiler.set_stance("force_eager")``;
- ``eager_variant``: eager again with one op on another exact backend (default
  ``kernels.causal_attention = sdpa``), the size of a change everyone accepts; or, with ``--variant
  autocast=off`` and fp32 weights, eager without bf16 autocast: the fp32 truth both bf16 steps approximate.

and the optimizer then steps with the eager gradients, so every step starts from the eager trajectory's
weights. Per step: the relative loss difference and the relative L2 distance of the whole gradient, compiled vs
eager, variant vs eager and compiled vs variant.

    PYTHONPATH=$PWD:/tmp/site python3 scripts/check/compile_numerics.py --config train_configs/k3_small.toml \\
        --steps 12 --out numerics.json [-- --model.dtype float32 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titan_kimi.config import load_job_config  # noqa: E402
from titan_kimi.data.causal_keys import longest_document  # noqa: E402
from titan_kimi.training.process.distributed import DistEnv  # noqa: E402
from titan_kimi.parallel.layout import resolve_layout  # noqa: E402
from titan_kimi.training.setup.build import model_args_from_config  # noqa: E402
from titan_kimi.training.optim.grad_clip import clip_gradients  # noqa: E402
from titan_kimi.training.setup.kernels import configure_kernels  # noqa: E402


def build_trainer(config: str, steps: int, dump: Path, overrides: list[str]):
    from titan_kimi.trainer import Trainer

    argv = ["--job.config_file", config, "--training.steps", str(steps), "--job.dump_folder", str(dump),
            "--checkpoint.enable", "false", "--validation.enable", "false", "--metrics.progress", "off",
            *overrides]
    cfg = load_job_config(argv, environ={})
    args = model_args_from_config(cfg)
    configure_kernels(cfg.kernels, args)
    return cfg, Trainer(cfg, args, resolve_layout(cfg, 1, args), DistEnv(0, 1, 0))


def loss_and_grads(trainer, batch: dict, normalizer: torch.Tensor, keys: int) -> tuple[float, list[torch.Tensor]]:
    """One forward + backward on ``batch``; returns the loss and the gradients (taken out of the parameters)."""
    loss = float(trainer._micro_step(batch, normalizer, backward=True, max_causal_keys=keys))
    grads = []
    for _, p in trainer.named_params:
        grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        p.grad = None
    return loss, grads


def grad_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all gradients together, in fp32."""
    num = sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.float().pow(2).sum()) for y in b)
    return (num / den) ** 0.5 if den > 0 else float("nan")


def worst_parameters(names: list[str], a: list[torch.Tensor], b: list[torch.Tensor], n: int = 3) -> list[list]:
    """The ``n`` parameters whose gradients differ most (relative L2), with that difference."""
    rel = []
    for name, x, y in zip(names, a, b):
        den = float(y.float().norm())
        rel.append([name, float((x.float() - y.float()).norm()) / den if den > 0 else 0.0])
    return sorted(rel, key=lambda r: -r[1])[:n]


def progress(step: int, what: str, t0: float) -> None:
    # Each pass can take minutes the first time (compiles; FLA tuning a dtype it has no shipped configs for):
    # say which one finished, so a run cut short by its time limit shows where the time went.
    print(f"  step {step}: {what} pass done at {time.perf_counter() - t0:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/k3_small.toml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variant", default="causal_attention=sdpa",
                        help="op=backend: the eager variant's exact kernel change; autocast=off: eager in fp32; several "
                        "joined by commas (autocast=off,kda=reference: the fp32 truth with the reference KDA, which "
                        "needs no fp32 tuning of FLA's kernels)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dump", type=Path, default=Path("/tmp/check_compile_numerics"))
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:split])
    changes = [part.partition("=") for part in opts.variant.split(",")]
    if not all(op and backend for op, _, backend in changes):
        parser.error(f"--variant {opts.variant!r}: expected op=backend[,op=backend], e.g. causal_attention=sdpa")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the trainer's own lines
    started = time.perf_counter()
    cfg, trainer = build_trainer(opts.config, opts.steps, opts.dump, argv[split + 1:])
    print(f"trainer built in {time.perf_counter() - started:.1f} s", flush=True)
    from lowerings.ops.registry import configure_backends, selected_backend

    switches = []  # each change's use(on) function
    for op, _, backend in changes:
        if op == "autocast":
            if backend != "off" or trainer.autocast_dtype is None:
                parser.error(f"--variant {opts.variant!r}: only autocast=off, for a recipe that computes under "
                             f"autocast (fp32 weights, bf16 compute); this one has autocast {trainer.autocast_dtype}")
            compute = trainer.autocast_dtype
            switches.append(lambda on, compute=compute: setattr(trainer, "autocast_dtype", None if on else compute))
        else:
            shipped = selected_backend(op)
            configure_backends({op: backend})  # fails here, before any step, when the variant cannot run
            configure_backends({op: shipped})
            switches.append(lambda on, op=op, backend=backend, shipped=shipped:
                            configure_backends({op: backend if on else shipped}))

    def use_variant(on: bool) -> None:
        for switch in switches:
            switch(on)
    data = iter(trainer.dataloader)
    names = [n for n, _ in trainer.named_params]
    rows = []
    for step in range(1, opts.steps + 1):
        t0 = time.perf_counter()
        host = next(data)
        normalizer = torch.full((), trainer._step_totals([host])[0], dtype=torch.float32, device=trainer.device)
        batch = {k: v.to(trainer.device) for k, v in host.items()}
        keys = longest_document(host["doc_ids"])
        compiled_loss, compiled = loss_and_grads(trainer, batch, normalizer, keys)
        progress(step, "compiled", t0)
        with torch.compiler.set_stance("force_eager"):
            eager_loss, eager = loss_and_grads(trainer, batch, normalizer, keys)
            progress(step, "eager", t0)
            use_variant(True)
            try:
                variant_loss, variant = loss_and_grads(trainer, batch, normalizer, keys)
            finally:
                use_variant(False)
            progress(step, opts.variant, t0)
        row = {
            "step": step, "loss_eager": eager_loss, "loss_compiled": compiled_loss, "loss_variant": variant_loss,
            "loss_rel_compiled": abs(compiled_loss - eager_loss) / abs(eager_loss),
            "loss_rel_variant": abs(variant_loss - eager_loss) / abs(eager_loss),
            "grad_rel_compiled": grad_distance(compiled, eager), "grad_rel_variant": grad_distance(variant, eager),
            "loss_rel_compiled_vs_variant": abs(compiled_loss - variant_loss) / abs(variant_loss),
            "grad_rel_compiled_vs_variant": grad_distance(compiled, variant),
            "worst_compiled": worst_parameters(names, compiled, eager),
            "worst_variant": worst_parameters(names, variant, eager),
        }
        del compiled, variant
        for (_, p), g in zip(trainer.named_params, eager):  # the eager trajectory goes on
            p.grad = g
        clip_gradients(trainer.named_params, cfg.training.max_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"step {step:3d} loss {eager_loss:.4f} | compiled vs eager: loss {row['loss_rel_compiled']:.2e} grad "
              f"{row['grad_rel_compiled']:.2e} | {opts.variant} vs eager: loss {row['loss_rel_variant']:.2e} grad "
              f"{row['grad_rel_variant']:.2e} | compiled vs variant: grad {row['grad_rel_compiled_vs_variant']:.2e} | "
              f"{row['seconds']:.1f} s", flush=True)
        print("    most different, compiled: " + ", ".join(f"{n} {r:.1e}" for n, r in row["worst_compiled"])
              + " | variant: " + ", ".join(f"{n} {r:.1e}" for n, r in row["worst_variant"]), flush=True)
    metrics = ("loss_rel_compiled", "loss_rel_variant", "grad_rel_compiled", "grad_rel_variant",
            "loss_rel_compiled_vs_variant", "grad_rel_compiled_vs_variant")
    summary = {key: statistics.median(r[key] for r in rows) for key in metrics}
    summary.update({f"max_{key}": max(r[key] for r in rows) for key in metrics})
    print("median / max over steps: compiled vs eager: loss {loss_rel_compiled:.2e} / {max_loss_rel_compiled:.2e}, "
          "grad {grad_rel_compiled:.2e} / {max_grad_rel_compiled:.2e}; variant vs eager: loss {loss_rel_variant:.2e}"
          " / {max_loss_rel_variant:.2e}, grad {grad_rel_variant:.2e} / {max_grad_rel_variant:.2e}; compiled vs "
          "variant: grad {grad_rel_compiled_vs_variant:.2e} / {max_grad_rel_compiled_vs_variant:.2e}".format(**summary))
    if opts.out:
        meta = {"config": opts.config, "overrides": argv[split + 1:], "variant": opts.variant,
                "compile_mode": cfg.compile.mode, "granularity": cfg.compile.granularity, "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        opts.out.write_text(json.dumps({"meta": meta, "summary": summary, "steps": rows}, indent=1))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
