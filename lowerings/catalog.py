"""The ops whose implementation the ``[kernels]`` config section chooses, with their backends and meaning.

The one list: the config section is generated from it, the backend registry accepts only what it names, and
the training entry point configures exactly these ops. Imports nothing (the config layer reads it without
torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpEntry:
    help: str
    backends: tuple[str, ...]  # "auto" comes on top: the first available of the op's preference order
    reference: str = "reference"  # the backend that runs anywhere: the default selection and auto's fallback


BACKEND_OPS: dict[str, OpEntry] = {
    "kda": OpEntry("Kimi Delta Attention backend", ("reference", "fla", "cudnn")),
    "indexer_topk": OpEntry(
        "DSA indexer scores + top-k backend: triton = the Triton kernel written here; cudnn = cuDNN frontend's sm90 "
        "DSA indexer over each document (its CuTe-DSL runtime comes with nvidia-cudnn-frontend; calls it cannot "
        "take run triton); auto = cudnn where it can run (faster on every layout measured), else triton on CUDA",
        ("reference", "triton", "cudnn")),
    "sparse_mla": OpEntry(
        "sparse MLA backend: triton = our forward (Gluon on Hopper) and Triton backward; cudnn = our forward and "
        "cuDNN frontend's sm90 DSA backward (faster than the Triton backward at K3's shapes, docs/perf.md); flash_mla = FlashMLA's "
        "sm90 sparse forward (scripts/tools/build_flash_mla.sh) and the Triton backward; calls a kernel cannot take run "
        "triton's; dense / reference = plain torch; auto = cudnn, then flash_mla, then triton, the first that can "
        "run here", ("dense", "reference", "triton", "cudnn", "flash_mla")),
    "indexer_distillation": OpEntry(
        "indexer distillation (indexer.mode = warmup / sparse): the main attention's head-summed probabilities at "
        "the keys used and the KL to the indexer's softmax, with its gradient into the indexer; triton = the "
        "Triton kernels written here; reference = row-chunked plain torch; auto = triton on CUDA",
        ("reference", "triton")),
    "situ_glu": OpEntry("SiTU-GLU expert activation backend", ("reference", "triton")),
    "short_conv": OpEntry(
        "the KDA layers' causal depthwise short convolution with SiLU (q, k, v): triton = forward and backward "
        "kernels written here, where the layer runs eager; reference = the plain formula; inside a compiled region "
        "both trace the formula for Inductor to fuse; auto = triton on CUDA",
        ("reference", "triton")),
    "routed_combine": OpEntry(
        "the MoE's rows around the routed experts (each token's latent row copied into expert order, and the "
        "router-weighted fp32 sum of its expert outputs): triton = gather-sum kernels written here, one pass each "
        "way, where the MoE runs eager (under expert parallelism, or compile off); reference = plain torch "
        "indexing; inside a compiled MoE both trace the plain indexing for Inductor to fuse; auto = triton on CUDA",
        ("reference", "triton")),
    "router_logits": OpEntry(
        "the MoE router's fp32 logits x @ gate^T: tensor_core = bf16 tensor-core GEMMs accumulating and writing "
        "fp32 (the products of bf16 numbers are exact in fp32), the reduction in 256-column slices summed in fp32 "
        "(the tensor cores' accumulation error grows with its length), its backward's fp32 gradient split into two "
        "bf16 halves (about 2^-17 relative) for one such GEMM per gradient; calls whose x and gate are not both bf16 "
        "CUDA tensors run the reference; reference = the plain fp32 matmul (a SIMT sgemm on CUDA); auto = "
        "tensor_core on CUDA",
        ("reference", "tensor_core")),
    "attn_res_mix": OpEntry("attention-residual mix backend", ("reference", "triton")),
    "linear_cross_entropy": OpEntry(
        "lm_head + cross-entropy backend",
        ("reference", "liger")),
    "causal_attention": OpEntry(
        "dense (document-)causal attention of the gated MLA layers: sdpa = SDPA with a dense boolean mask; flex = "
        "FlexAttention with a block-sparse document-causal BlockMask for packed documents (plain causal rows take "
        "SDPA's causal kernel under both); varlen = torch's FlashAttention varlen kernel over the documents' "
        "cu_seqlens (precompiled: nothing to compile; what it cannot take, e.g. context parallelism's placed queries, "
        "runs as flex on CUDA); auto = varlen on CUDA (nothing to compile at the first step, the step as fast as "
        "flex's: docs/perf.md), sdpa elsewhere",
        ("sdpa", "flex", "varlen"), reference="sdpa"),
}
