"""Model args, tokenizer and model construction (text or image-text, with or without LoRA) from the job config."""

from __future__ import annotations

import torch

from titan_kimi.checkpoint.hf_config import model_args_from_hf, read_hf_config
from titan_kimi.data import TOKENIZER_DIR, KimiTokenizer
from titan_kimi.data.chat import IMAGE_PLACEHOLDER
from titan_kimi.dtypes import DTYPES
from titan_kimi.training.setup.indexer_training import apply_indexer_trainability, indexer_args
from titan_kimi.lora import LoRASettings, apply_lora
from titan_kimi.models.kimi_k3 import KimiK3Model, KimiK3ModelArgs, model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype
from titan_kimi.models.kimi_k3.multimodal import KimiK3VLModel
from titan_kimi.models.kimi_k3.state_dict_adapter import vision_args_from_hf_config
from titan_kimi.models.kimi_k3.vision_args import KimiK3VisionArgs, vision_args_for


def model_args_from_config(cfg) -> KimiK3ModelArgs:
    """The flavor's args, or those of ``model.hf_config_path`` (a checkpoint config.json) when given."""
    if cfg.model.hf_config_path:
        try:
            args = model_args_from_hf(cfg.model.hf_config_path)
        except ValueError as err:  # it names the file; say which key pointed there
            raise ValueError(f"model.hf_config_path: {err}") from None
    else:
        args = model_args_for(cfg.model.flavor)
    return indexer_args(args, cfg).replace(max_seq_len=cfg.training.seq_len,
                                           dsa_dense_shortcut=cfg.model.dsa_dense_shortcut)


def tokenizer_from_config(cfg, args: KimiK3ModelArgs) -> KimiTokenizer:
    tokenizer = KimiTokenizer(cfg.model.tokenizer_path or TOKENIZER_DIR)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{args.vocab_size}; use a tokenizer that fits the model (or a model flavor with a larger vocab)"
        )
    return tokenizer


def vision_args_from_config(cfg, tokenizer: KimiTokenizer) -> KimiK3VisionArgs | None:
    """The tower of an image-text model: ``model.vision_flavor``, or the ``vision_config`` of
    ``model.hf_config_path``; None for a text model. The image placeholder is the tokenizer's."""
    config = None
    if cfg.model.hf_config_path:
        try:
            config = read_hf_config(cfg.model.hf_config_path)
        except ValueError as err:
            raise ValueError(f"model.hf_config_path: {err}") from None
        if "vision_config" not in config:
            config = None
    if config is None and not cfg.model.vision_flavor:
        return None
    if config is not None and cfg.model.vision_flavor:
        raise ValueError(
            f"model.vision_flavor = {cfg.model.vision_flavor!r} and model.hf_config_path = "
            f"{cfg.model.hf_config_path!r} (which has a vision_config) both name a vision tower; keep one"
        )
    placeholder = tokenizer.special_tokens.get(IMAGE_PLACEHOLDER)
    if placeholder is None:
        raise ValueError(f"model.tokenizer_path: the tokenizer has no {IMAGE_PLACEHOLDER} token, which an "
                         f"image-text model needs")
    if config is None:
        return vision_args_for(cfg.model.vision_flavor, media_placeholder_token_id=placeholder)
    vision = vision_args_from_hf_config(config)
    if vision.media_placeholder_token_id != placeholder:
        raise ValueError(
            f"model.hf_config_path: media_placeholder_token_id = {vision.media_placeholder_token_id} but the "
            f"tokenizer's {IMAGE_PLACEHOLDER} is {placeholder}; use the checkpoint's tokenizer"
        )
    return vision


def build_meta_model(
    args: KimiK3ModelArgs,
    dtype: torch.dtype,
    *,
    indexer_mode: str = "frozen",
    warmup_trains: str = "indexer",
    vision: KimiK3VisionArgs | None = None,
    freeze_vision_tower: bool = True,
    lora: LoRASettings | None = None,
    layer_range: tuple[int, int] | None = None,
    allow_block_cut: bool = False,
) -> KimiK3Model:
    """The model (or the pipeline stage of layers ``layer_range``) on the meta device in ``dtype``
    (fp32-by-design parameters stay fp32): the image-text model when ``vision`` is given. With ``lora`` every
    base weight is frozen and adapters are added (materialise, then ``titan_kimi.lora.reset_adapters``);
    without, (``freeze_vision_tower``) the tower is frozen. The indexer trains as ``indexer_mode`` and
    ``warmup_trains`` say (``[indexer]``; ``titan_kimi.training.setup.indexer_training``). ``allow_block_cut``:
    a benchmark's part that ends inside an AttnRes block (``KimiK3Model``)."""
    with torch.device("meta"):
        model = (KimiK3VLModel(args, vision, layer_range, allow_block_cut=allow_block_cut) if vision is not None
                 else KimiK3Model(args, layer_range=layer_range, allow_block_cut=allow_block_cut))
    cast_model_dtype(model, dtype)
    if vision is not None and freeze_vision_tower and model.vision_tower is not None:
        model.vision_tower.requires_grad_(False)
    if lora is not None:  # a stage may hold none of a target group's modules (the tower is on the first)
        apply_lora(model, lora, require_matches=layer_range is None)
    apply_indexer_trainability(model, indexer_mode, warmup_trains)
    return model


def build_model_from_config(cfg, args: KimiK3ModelArgs, tokenizer: KimiTokenizer,
                            layer_range: tuple[int, int] | None = None) -> KimiK3Model:
    """``build_meta_model`` with the job config's dtype, vision tower, freezing and ``[lora]`` settings."""
    return build_meta_model(
        args, DTYPES[cfg.model.dtype], indexer_mode=cfg.indexer.mode, warmup_trains=cfg.indexer.warmup_trains,
        vision=vision_args_from_config(cfg, tokenizer), freeze_vision_tower=cfg.model.freeze_vision_tower,
        lora=LoRASettings.from_config(cfg.lora) if cfg.lora.enable else None, layer_range=layer_range,
    )


def dataloader_from_config(cfg, args: KimiK3ModelArgs, tokenizer: KimiTokenizer, path: str, *,
                           vision: KimiK3VisionArgs | None, seed: int, shuffle: bool, dp_rank: int = 0,
                           dp_world_size: int = 1, infinite: bool = True, split: str = "train"):
    """The ``[data]`` section's loader of ``path`` ("" = the bundled sample) for one data-parallel rank; MedPix
    gets the image processor of the model's tower (``vision``)."""
    from titan_kimi.data import build_dataloader
    from titan_kimi.data.image_processor import ImageProcessor

    data, t = cfg.data, cfg.training
    processor = None
    if data.dataset == "medpix":
        if vision is None:
            raise ValueError(f"data.dataset = 'medpix' needs an image-text model, but model.hf_config_path = "
                             f"{cfg.model.hf_config_path!r} has no vision_config; set model.vision_flavor")
        processor = ImageProcessor(patch_size=vision.patch_size, merge_kernel=vision.merge_kernel,
                                   min_pixels=data.image_min_pixels, max_pixels=data.image_max_pixels)
    return build_dataloader(
        data.dataset, path or None, tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
        dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed, shuffle=shuffle, infinite=infinite,
        vocab_size=args.vocab_size, split=split, image_processor=processor,
    )
