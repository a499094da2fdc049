"""Bytes a layer keeps per microbatch under ``activation_checkpoint.selective_ac_option = "mixers"``: its token
mixer's outputs, as the GPU backends return them (``titan_kimi.parallel.activation_checkpoint.TOKEN_MIXERS``):

- KDA (``titan_kimi::kda``, FLA): the output ``[T, H, V]`` in bf16, the inverse norms of q and k ``[T, H]`` in
  fp32 and the intra-chunk matrices Aqk / Akk ``[T, H, 64]`` in bf16; under context parallelism
  (``titan_kimi::kda_cp``) also the incoming state ``[H, K, V]`` in fp32 of each of the rank's sequence parts;
- DSA: sparse MLA's output ``[T, H, kv_lora]`` in bf16 and its log-sum-exp ``[T, H]`` in fp32, and the indexer's
  top-k ``[T, min(topk, T)]`` in int32;
- MLA (dense attention, also a DSA layer on its dense shortcut): the output ``[T, H, v_head_dim]`` in bf16 and
  its log-sum-exp ``[H, T]`` in fp32.
"""

from __future__ import annotations

from titan_kimi.models.kimi_k3.args import KimiK3ModelArgs

BF16, FP32, INT32 = 2, 4, 4
KDA_CHUNK = 64  # FLA's chunk: the width of Aqk and Akk (lowerings/kernels/fla_kda.py)


def kept_bytes(args: KimiK3ModelArgs, kind: str, tokens: int, *, state_parts: int = 0) -> int:
    """Bytes a layer of ``kind`` (``stage_work.layer_kind``) keeps for one microbatch of ``tokens`` tokens (this
    rank's, under CP), with ``state_parts`` incoming KDA states per row (the rank's sequence parts under CP, else
    0)."""
    attention = kind.split("+")[0]
    if attention not in ("kda", "dsa", "mla"):
        raise ValueError(f"layer kind {kind!r}: expected kda, dsa or mla attention")
    if attention == "kda":
        heads, dim = args.kda_num_heads, args.kda_head_dim
        return tokens * heads * (dim * BF16 + 2 * FP32 + 2 * KDA_CHUNK * BF16) + state_parts * heads * dim * dim * FP32
    heads = args.n_heads
    if attention == "dsa":
        return tokens * heads * (args.kv_lora_rank * BF16 + FP32) + tokens * min(args.index_topk, tokens) * INT32
    return tokens * heads * (args.v_head_dim * BF16 + FP32)
