"""Model args, tokenizer and model construction from the job config."""

from __future__ import annotations

import torch

from titan_kimi.checkpoint.hf_config import model_args_from_hf
from titan_kimi.data import TOKENIZER_DIR, KimiTokenizer
from titan_kimi.models.kimi_k3 import KimiK3Model, KimiK3ModelArgs, model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype


def model_args_from_config(cfg) -> KimiK3ModelArgs:
    """The flavor's args, or those of ``model.hf_config_path`` (a checkpoint config.json) when given."""
    if cfg.model.hf_config_path:
        try:
            args = model_args_from_hf(cfg.model.hf_config_path)
        except ValueError as err:  # it names the file; say which key pointed there
            raise ValueError(f"model.hf_config_path: {err}") from None
    else:
        args = model_args_for(cfg.model.flavor)
    args.max_seq_len = cfg.training.seq_len
    return args


def tokenizer_from_config(cfg, args: KimiK3ModelArgs) -> KimiTokenizer:
    tokenizer = KimiTokenizer(cfg.model.tokenizer_path or TOKENIZER_DIR)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{args.vocab_size}; use a tokenizer that fits the model (or a model flavor with a larger vocab)"
        )
    return tokenizer


def build_meta_model(args: KimiK3ModelArgs, dtype: torch.dtype, *, freeze_indexer: bool,
                     layer_range: tuple[int, int] | None = None) -> KimiK3Model:
    """The model (or the pipeline stage of layers ``layer_range``) on the meta device in ``dtype``
    (fp32-by-design parameters stay fp32)."""
    with torch.device("meta"):
        model = KimiK3Model(args, layer_range=layer_range)
    cast_model_dtype(model, dtype)
    if not freeze_indexer:
        raise ValueError(
            "model.freeze_indexer = false: the indexer only receives a gradient from a distillation loss, which "
            "titan_kimi does not build yet; keep it true"
        )
    return model
