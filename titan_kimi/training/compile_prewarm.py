"""``compile.prewarm_modules``: compile the model's module kinds side by side, in background processes at launch.

With ``compile.granularity = module`` a module's compiled graph does not depend on its layer's position, and
Inductor's FX-graph and AOT-autograd caches are keyed by the graph and its inputs' metadata: a lone block's
attention compiled in another process on inputs of the same shapes is a cache hit for the model's (checked on
CPU, tests/test_compile_prewarm.py). Here one process per kind (norm + attention of each attention type, norm +
FFN of each FFN type) builds that one layer from the job's own config, runs its compiled modules forward and
backward on the run's first batch layout, and exits; the trainer waits for them before its first step and
then loads their graphs instead of compiling them one after another. Only single-process runs (no CP, EP or
PP; a text model), where the trainer's inputs are known here exactly. A process that fails costs only time.

    python -m titan_kimi.training.compile_prewarm --layer 3 --part attention -- <the job's command-line arguments>
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

from titan_kimi.dtypes import DTYPES
from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

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


def _first_batch(cfg, args, tokenizer) -> dict:
    from titan_kimi.data import build_dataloader

    t, data = cfg.training, cfg.data
    loader = build_dataloader(data.dataset, data.path or None, tokenizer, seq_len=t.seq_len,
                              local_batch_size=t.local_batch_size, dp_rank=0, dp_world_size=1, seed=cfg.job.seed,
                              shuffle=data.shuffle, infinite=True, vocab_size=args.vocab_size, split="train")
    return next(iter(loader))


def prewarm(job_argv: list[str], layer: int, part: str) -> str:
    """Compile and run layer ``layer``'s ``part`` modules as the trainer will; returns a line for the log."""
    from lowerings.inductor.modes import compile_mode
    from titan_kimi.config import load_job_config
    from titan_kimi.data.causal_keys import longest_document
    from titan_kimi.parallel.compile import module_regions
    from titan_kimi.parallel.parallelize import mixed_precision_dtype
    from titan_kimi.training.build import build_model_from_config, model_args_from_config, tokenizer_from_config
    from titan_kimi.training.kernels import configure_kernels, import_backend_libraries

    if part not in PARTS:
        raise ValueError(f"part = {part!r}; valid: {PARTS}")
    t0 = time.perf_counter()
    cfg = load_job_config(job_argv)
    args = model_args_from_config(cfg)
    resolved = configure_kernels(cfg.kernels)
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
    batch = _first_batch(cfg, args, tokenizer)
    B, S = batch["input_ids"].shape
    doc_ids = batch["doc_ids"].to(device)
    seq = model.build_sequence(B, S, device, doc_ids)
    seq.dsa_dense = model.dsa_dense(seq, longest_document(batch["doc_ids"]))
    autocast = mixed_precision_dtype(cfg)  # on one device autocast stands in for FSDP's mixed precision
    stored = DTYPES[cfg.model.dtype]
    dtype = input_dtype(args, layer, part, stored=stored, compute=autocast or stored)
    x = torch.randn(B, S, args.dim, device=device, dtype=dtype, requires_grad=True)
    context = (torch.autocast(device.type, dtype=autocast) if autocast else torch.autocast(device.type, enabled=False))
    if spec.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    with context, spec.lowering_scope():
        out = module(norm(x), seq) if part == "attention" else module(norm(x))
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return f"layer {layer} {part} compiled in {time.perf_counter() - t0:.1f} s"


def is_image_text(cfg) -> bool:
    """Whether the job's model has a vision tower (``model.vision_flavor``, or a vision_config in its HF config)."""
    if cfg.model.vision_flavor:
        return True
    if not cfg.model.hf_config_path:
        return False
    from titan_kimi.checkpoint.hf_config import read_hf_config

    return "vision_config" in read_hf_config(cfg.model.hf_config_path)


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
        self.processes: list[tuple[str, subprocess.Popen, object]] = []

    def start(self, args: KimiK3ModelArgs, cfg, job_argv: list[str]) -> int:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(name, None)  # not a rank of the job
        from titan_kimi.parallel.parallelize import mixed_precision_dtype

        stored = DTYPES[cfg.model.dtype]
        for layer, part in prewarm_kinds(args, stored=stored, compute=mixed_precision_dtype(cfg) or stored):
            output = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: never blocks on a full pipe
            command = [sys.executable, "-m", "titan_kimi.training.compile_prewarm", "--layer", str(layer),
                       "--part", part, "--", *job_argv]
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
            self.processes.append((f"layer {layer} {part}", process, output))
        logger.info("compile.prewarm_modules: compiling %s in %d processes",
                    ", ".join(name for name, _, _ in self.processes), len(self.processes))
        return len(self.processes)

    def wait(self, timeout_s: float) -> None:
        """Wait for every process (stopping those still running after ``timeout_s``) and log each outcome."""
        deadline = time.monotonic() + timeout_s
        for name, process, output in self.processes:
            stopped = False
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                stopped = True
            output.seek(0)
            lines = output.read().strip().splitlines()
            output.close()
            ours = [line for line in lines if line.startswith(RESULT_PREFIX)]  # torch may log to the same file
            last = ours[-1][len(RESULT_PREFIX):] if ours else (lines[-1] if lines else "(no output)")
            if stopped:
                logger.info("compile.prewarm_modules: %s stopped before it finished", name)
            elif process.returncode == 0:
                logger.info("compile.prewarm_modules: %s", last)
            else:
                logger.warning("compile.prewarm_modules: %s failed (exit %s; the first step compiles it itself): %s",
                               name, process.returncode, last)
        self.processes = []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m titan_kimi.training.compile_prewarm --layer L --part P -- <job args>")
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
