"""Converts Kimi K3 / K3.1 checkpoints between the HF layout and DCP: python scripts/tools/convert_checkpoint.py hf-to-dcp|dcp-to-hf SRC OUT

    # HF safetensors (MXFP4 or bf16 experts) -> model-only DCP checkpoint (model args from HF_DIR/config.json)
    python scripts/tools/convert_checkpoint.py hf-to-dcp HF_DIR OUT_DIR [--flavor k31_debug | --hf-config config.json]
        [--vision-flavor moonvit3d | --text-only]

    # DCP (a training step-N folder, or the checkpoint folder: its latest step) -> HF safetensors
    python scripts/tools/convert_checkpoint.py dcp-to-hf DCP_DIR OUT_DIR [--flavor k3 | --hf-config config.json]
        [--vision-flavor moonvit3d] [--dtype bfloat16] [--fp32-params-dtype float32] [--mxfp4-experts]
        [--max-shard-size 5GB]

An image-text checkpoint keeps its vision tower and projector (``vision_tower.*``, ``mm_projector.*``, the public
K3.1-Pro names) both ways. The tower comes from --vision-flavor, else from the config.json that gives the text
model (hf-to-dcp without --flavor: its vision_config; --text-only drops the tower), else (dcp-to-hf) from the
vision_args.json saved with the checkpoint.

Both directions hold one tensor (HF -> DCP) or one shard (DCP -> HF) in memory at a time, and write to a
temporary folder that is renamed into place when complete. The model args of dcp-to-hf default to the
model_args.json saved with the checkpoint. An output that is, contains or lies inside the source is refused.
Exit status 2 and a one-paragraph message on a bad checkpoint, flag or path.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from titan_kimi.checkpoint.convert import (damage_outside_model, dcp_to_hf, hf_to_dcp,  # noqa: E402
                                           refuse_output_in_source)
from titan_kimi.checkpoint.hf_config import model_args_from_hf, read_hf_config  # noqa: E402
from titan_kimi.checkpoint.hf_writer import DEFAULT_MAX_SHARD_BYTES  # noqa: E402
from titan_kimi.checkpoint.progress import ProgressBar  # noqa: E402
from titan_kimi.models.kimi_k3 import model_args_for  # noqa: E402
from titan_kimi.models.kimi_k3.state_dict_adapter import vision_args_from_hf_config  # noqa: E402
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs, vision_args_for  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least one byte")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_flags(p: argparse.ArgumentParser, required_hint: str) -> None:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--flavor",
                           help=f"model flavor from the registry (e.g. k3, k31, k31_debug); {required_hint}")
        group.add_argument("--hf-config", type=Path, help="an HF config.json (composite kimi_k3 or bare text config)")
        p.add_argument("--vision-flavor", help="the vision tower of an image-text model (e.g. moonvit3d, "
                                                "moonvit3d_debug); default: see below")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the written tensors")
        p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    h2d = sub.add_parser("hf-to-dcp", help="HF safetensors folder -> model-only DCP checkpoint")
    h2d.add_argument("hf_dir", type=Path)
    h2d.add_argument("out_dir", type=Path)
    model_flags(h2d, "default: HF_DIR/config.json")
    h2d.add_argument("--text-only", action="store_true",
                     help="convert the text model only: skip the vision tower and projector keys")

    d2h = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> HF safetensors folder")
    d2h.add_argument("dcp_dir", type=Path)
    d2h.add_argument("out_dir", type=Path)
    model_flags(d2h, "default: the model_args.json saved with the checkpoint")
    d2h.add_argument("--fp32-params-dtype", choices=sorted(DTYPES),
                     help="dtype for the tensors the model keeps in fp32 (A_log, dt_bias, convs, ...); default --dtype")
    d2h.add_argument("--mxfp4-experts", action="store_true", help="write routed experts as MXFP4 packed/scale pairs")
    d2h.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                     help="largest safetensors shard (default 5GiB)")
    return parser


def _latest_step(path: Path) -> Path:
    """A step folder as given, or the latest complete step-N of a checkpoint folder."""
    if (path / ".metadata").is_file():
        return path
    steps = sorted(
        (int(p.name.split("-", 1)[1]), p) for p in path.glob("step-*")
        if p.name.split("-", 1)[1].isdigit() and (p / ".metadata").is_file()
    )
    if not steps:
        raise ValueError(f"{str(path)!r} is not a DCP checkpoint (no .metadata) and holds no complete step-N folders")
    print(f"convert_checkpoint: using the latest step, {steps[-1][1]}", file=sys.stderr)
    return steps[-1][1]


def _hf_vision(opts: argparse.Namespace) -> KimiK3VisionArgs | None:
    """hf-to-dcp's tower: --vision-flavor, or the vision_config of the config.json that gives the text model."""
    if opts.vision_flavor:
        if opts.text_only:
            raise ValueError("--vision-flavor and --text-only contradict each other; keep one")
        return vision_args_for(opts.vision_flavor)
    if opts.flavor or opts.text_only:
        return None
    config = read_hf_config(opts.hf_config if opts.hf_config else opts.hf_dir)
    return vision_args_from_hf_config(config) if "vision_config" in config else None


def run(argv: list[str] | None = None) -> Path:
    opts = build_parser().parse_args(argv)
    dtype = DTYPES[opts.dtype]
    progress = None if opts.quiet else ProgressBar(opts.command)
    if opts.command == "hf-to-dcp":
        if opts.flavor:
            args = model_args_for(opts.flavor)
        else:
            args = model_args_from_hf(opts.hf_config if opts.hf_config else opts.hf_dir)
        return hf_to_dcp(opts.hf_dir, opts.out_dir, args=args, vision=_hf_vision(opts), dtype=dtype,
                         overwrite=opts.overwrite, progress=progress)
    base = read_hf_config(opts.hf_config) if opts.hf_config else None
    args = model_args_for(opts.flavor) if opts.flavor else model_args_from_hf(opts.hf_config) if base else None
    vision = vision_args_for(opts.vision_flavor) if opts.vision_flavor else None
    refuse_output_in_source(opts.dcp_dir, opts.out_dir)  # the folder given, not only the step chosen in it
    step = _latest_step(opts.dcp_dir)
    out = dcp_to_hf(
        step, opts.out_dir, args=args, vision=vision, dtype=dtype,
        fp32_params_dtype=DTYPES[opts.fp32_params_dtype] if opts.fp32_params_dtype else None,
        mxfp4_experts=opts.mxfp4_experts, max_shard_bytes=opts.max_shard_size, base_config=base,
        overwrite=opts.overwrite, progress=progress,
    )
    for damage in damage_outside_model(step):
        print(f"convert_checkpoint: warning: {step} cannot be resumed from (its model weights were read whole and "
              f"written): {damage.describe()}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        out = run(argv)
    except ValueError as err:
        print(f"convert_checkpoint: error: {err}", file=sys.stderr)
        return 2
    print(f"convert_checkpoint: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
