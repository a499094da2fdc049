"""``compile.prewarm_modules``: compile the model's module kinds side by side, in background processes at launch.

With ``compile.granularity = module`` a module's compiled graph does not depend on its layer's position, and
Inductor's FX-graph and AOT-autograd caches are keyed by the graph and its inputs' metadata: a lone block's
attention compiled in another process on inputs of the same shapes is a cache hit for the model's (checked on
CPU, tests/test_compile_prewarm.py). Here one process per kind (norm + attention of each attention type, norm +
FFN of each FFN type) builds that one layer from the job's own config, runs its compiled modules forward and
backward on the run's first batch layout, and exits; the trainer waits for them before its first step and
then loads their graphs instead of compiling them one after another. Only single-process runs (no CP, EP or
PP; a text model), where the trainer's inputs are known here exactly. A process that fails costs only time.

    python -m titan_kimi.compile.module_prewarm --layer 3 --part attention -- <the job's command-line arguments>
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs
from titan_kimi.compile.report import CompileReport
from titan_kimi.training.process.start_time import process_start_time
from titan_kimi.training.process.helper_process import HelperProcess

logger = logging.getLogger("titan_kimi")

PARTS = ("attention", "ffn")
RESULT_PREFIX = "compile_prewarm: "


def input_dtype(args: KimiK3ModelArgs, layer: int, part: str, *, stored: torch.dtype,
                compute: torch.dtype) -> torch.dtype:
    """The dtype of ``part``'s input at ``layer``: the residual stream as the model runs it. It starts as the
    embedding, in the stored dtype. Under autocast (``compute`` lower than ``stored``) the attention output is in
    ``compute``; with AttnRes the first layer starts a block, whose partial sum is that output, and the mixes
    keep the partial's dtype, so every later input is in ``compute``. Without AttnRes the sum stays ``stored``."""
    if layer == 0 and part == "attention":
        return stored
    return compute if args.attn_res_block_size else stored


def prewarm_kinds(args: KimiK3ModelArgs, *, stored: torch.dtype, compute: torch.dtype) -> list[tuple[int, str]]:
    """``(layer, part)`` for the first layer of each attention type and each FFN type of the model, per input
    dtype (`input_dtype`): the graphs the model's first step compiles."""
    kinds, seen = [], set()
    for layer in range(args.n_layers):
        for part, kind in (("attention", args.is_kda_layer(layer)), ("ffn", args.is_moe_layer(layer))):
            key = (part, kind, input_dtype(args, layer, part, stored=stored, compute=compute))
            if key not in seen:
                seen.add(key)
                kinds.append((layer, part))
    return kinds


def prewarm(job_argv: list[str], layer: int, part: str) -> str:
    """Compile and run layer ``layer``'s ``part`` modules as the trainer will; returns a line for the log."""
    from lowerings.inductor.modes import compile_mode
    from titan_kimi.config import load_job_config
    from titan_kimi.data.causal_keys import longest_document
    from titan_kimi.parallel.compile import module_regions
    from titan_kimi.parallel.parallelize import mixed_precision_dtype
    from titan_kimi.training.setup.build import (build_model_from_config, dataloader_from_config,
                                                 model_args_from_config, tokenizer_from_config)
    from titan_kimi.training.setup.kernels import configure_kernels, import_backend_libraries

    if part not in PARTS:
        raise ValueError(f"part = {part!r}; valid: {PARTS}")
    t0 = time.perf_counter()
    started = process_start_time()
    imports = f" after {time.time() - started:.1f} s of imports" if started is not None else ""
    cfg = load_job_config(job_argv)
    args = model_args_from_config(cfg)
    resolved = configure_kernels(cfg.kernels, args)
    if resolved["kda"] == "fla":
        from lowerings.kernels.fla_kda import prepare_fla_configs

        prepare_fla_configs()
    import_backend_libraries(resolved)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tokenizer = tokenizer_from_config(cfg, args)
    model = build_model_from_config(cfg, args, tokenizer)  # on meta: only the one layer is materialised
    block = model.layers[str(layer)]
    block.to_empty(device=device)
    block.init_weights()
    norm, module = module_regions(block)[:2] if part == "attention" else module_regions(block)[2:]
    spec = compile_mode(cfg.compile.mode)
    options = spec.compile_options()
    norm.compile(fullgraph=cfg.compile.fullgraph, **options)
    module.compile(fullgraph=cfg.compile.fullgraph, **options)
    # the trainer's first batch (same loader, seed and order): its document count sets cu_seqlens' shape
    loader = dataloader_from_config(cfg, args, tokenizer, cfg.data.path, vision=None, seed=cfg.job.seed,
                                    shuffle=cfg.data.shuffle)
    batch = next(iter(loader))
    B, S = batch["input_ids"].shape
    doc_ids = batch["doc_ids"].to(device)
    seq = model.build_sequence(B, S, device, doc_ids)
    seq.dsa_dense = model.dsa_dense(seq, longest_document(batch["doc_ids"]))
    autocast = mixed_precision_dtype(cfg)  # on one device autocast stands in for FSDP's mixed precision
    stored = DTYPES[cfg.model.dtype]
    dtype = input_dtype(args, layer, part, stored=stored, compute=autocast or stored)
    x = torch.randn(B, S, args.dim, device=device, dtype=dtype, requires_grad=True)
    context = (torch.autocast(device.type, dtype=autocast) if autocast else torch.autocast(device.type, enabled=False))
    t_setup, report = time.perf_counter(), CompileReport()
    if spec.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    with context, spec.lowering_scope():
        if part == "attention":
            out = module(norm(x), seq)
        else:  # as the block calls it: the MoE skips padding tokens
            out = module(norm(x), seq.is_real) if block.moe_enabled else module(norm(x))
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # where its time went: the set-up (config, libraries, the layer, the batch), then the compile's own phases
    done = time.perf_counter()
    _, _, parts = report.since_last()
    report.close()
    return "; ".join([f"layer {layer} {part} compiled in {done - t0:.1f} s{imports} (set-up "
                      f"{t_setup - t0:.1f} s, compile and run {done - t_setup:.1f} s)", *parts])


def unsupported(cfg, layout, *, image_text: bool) -> str | None:
    """Why this run cannot prewarm its modules (None when it can), as the end of a sentence."""
    c = cfg.compile
    if c.mode == "none" or c.granularity != "module" or "model" not in c.components:
        return (f"needs compile.granularity = 'module' with the model compiled (compile.mode = {c.mode!r}, "
                f"granularity = {c.granularity!r}, components = {c.components})")
    if layout.world_size != 1:
        return f"needs a single process; this run has {layout.world_size}"
    if image_text:
        return "needs a text model; this one has a vision tower"
    return None


class ModulePrewarm:
    """One background process per module kind (`start`); `wait` before the first step logs each outcome."""

    def __init__(self) -> None:
        self.processes: list[HelperProcess] = []

    def start(self, args: KimiK3ModelArgs, cfg, job_argv: list[str]) -> int:
        from titan_kimi.parallel.parallelize import mixed_precision_dtype

        stored = DTYPES[cfg.model.dtype]
        for layer, part in prewarm_kinds(args, stored=stored, compute=mixed_precision_dtype(cfg) or stored):
            command = [sys.executable, "-m", "titan_kimi.compile.module_prewarm", "--layer", str(layer),
                       "--part", part, "--", *job_argv]
            self.processes.append(HelperProcess(f"layer {layer} {part}", command))
        logger.info("compile.prewarm_modules: compiling %s in %d processes",
                    ", ".join(p.name for p in self.processes), len(self.processes))
        return len(self.processes)

    def wait(self, timeout_s: float) -> None:
        """Wait for every process (stopping those still running after ``timeout_s``) and log each outcome."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            outcome = process.finish(deadline - time.monotonic(), result_prefix=RESULT_PREFIX)
            if outcome.status == "stopped":
                logger.info("compile.prewarm_modules: %s stopped before it finished", process.name)
            elif outcome.status == "done":
                logger.info("compile.prewarm_modules: %s", outcome.line)
            else:
                logger.warning("compile.prewarm_modules: %s failed (exit %s; the first step compiles it itself): %s",
                               process.name, outcome.returncode, outcome.line)
        self.processes = []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m titan_kimi.compile.module_prewarm --layer L --part P -- <job args>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument("--part", choices=PARTS, required=True)
    opts = parser.parse_args(argv[:split])
    logging.basicConfig(level=logging.WARNING)
    print(RESULT_PREFIX + prewarm(argv[split + 1:], opts.layer, opts.part), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
