"""Flavors of the one model definition, from a CPU debug model to the full 2.78T K3 / K3.1."""

from __future__ import annotations

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

_K31_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)

# Trains on 2 CPU cores in seconds: two AttnRes blocks of 4 layers, KDA + MLA/DSA, a dense layer 0 and MoE.
_DEBUG = dict(
    vocab_size=2048, dim=128, n_layers=8, attn_res_block_size=4,
    kda_num_heads=2, kda_head_dim=32,
    n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    inter_dim=256, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_inter_dim=64, moe_latent_dim=64,
)
_DEBUG_INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=32)

# One H200 at 8K tokens (fixed by spec/design.md decision 6 so results compare across projects).
_SMALL = dict(
    vocab_size=163840, dim=2048, n_layers=16, attn_res_block_size=12,
    kda_num_heads=16, kda_head_dim=128,
    n_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    inter_dim=5632, num_experts=64, num_experts_per_tok=6, num_shared_experts=2, moe_inter_dim=768,
    moe_latent_dim=1024,
)

# Two H200s with FSDP2 (bf16 moments): the K3 geometry at 24 layers and a quarter of the width.
_MEDIUM = dict(
    vocab_size=163840, dim=3072, n_layers=24, attn_res_block_size=12,
    kda_num_heads=24, kda_head_dim=128,
    n_heads=24, q_lora_rank=1024, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    inter_dim=8448, num_experts=96, num_experts_per_tok=8, num_shared_experts=2, moe_inter_dim=1024,
    moe_latent_dim=1536,
)

_FLAVORS: dict[str, dict] = {
    "k3_debug": _DEBUG,
    "k31_debug": {**_DEBUG, **_DEBUG_INDEXER},
    # The debug models in 2-layer AttnRes blocks (4 blocks): pipelines of up to 4 stages, virtual ones included.
    "k3_debug_pp": {**_DEBUG, "attn_res_block_size": 2},
    "k31_debug_pp": {**_DEBUG, **_DEBUG_INDEXER, "attn_res_block_size": 2},
    "k3_small": _SMALL,
    "k31_small": {**_SMALL, **_K31_INDEXER},
    # k31_small in 4-layer AttnRes blocks (4 blocks): the two-stages-per-rank schedules (ZBVZeroBubble, DualPipeV,
    # Interleaved*) need 4 stages at PP2, and k31_small's 12-layer blocks give only 2. A different model (AttnRes
    # mixes every 4 layers): compare it with itself on one GPU.
    "k31_small_pp": {**_SMALL, **_K31_INDEXER, "attn_res_block_size": 4},
    "k3_medium": _MEDIUM,
    "k31_medium": {**_MEDIUM, **_K31_INDEXER},
    "k3": {},
    "k31": dict(_K31_INDEXER),
}


def added_indexer_fields(flavor: str | None) -> dict:
    """The indexer fields a K3 model gains (``model.add_indexer``): those of the flavor's K3.1 sibling
    (``k3_debug`` -> ``k31_debug``), or the K3.1 indexer for a model built from a config.json (``flavor`` None)."""
    sibling = _FLAVORS.get("k31" + flavor[2:], {}) if flavor and flavor.startswith("k3") else {}
    return {k: sibling.get(k, v) for k, v in _K31_INDEXER.items()}


def flavor_names() -> list[str]:
    return list(_FLAVORS)


def model_args_for(flavor: str, **overrides) -> KimiK3ModelArgs:
    """The model args of ``flavor``, with optional field overrides."""
    if flavor not in _FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; valid flavors: {flavor_names()}")
    return KimiK3ModelArgs(**{**_FLAVORS[flavor], **overrides})
