// A minimal Python binding of FlashMLA's sm90 sparse prefill forward, compiled by scripts/tools/build_flash_mla.sh build.
//
// FlashMLA's own binding (csrc/api/api.cpp) links every kernel of the library (dense / sparse decode, sm100
// prefill, ...). This one exposes only `sparse_prefill_fwd`, with the same signature and results as FlashMLA's
// `flash_mla.cuda.sparse_prefill_fwd`, so FlashMLA's unchanged Python package (flash_mla/flash_mla_interface.py)
// runs `flash_mla_sparse_fwd` on it. Only the d_qk = 576 kernels are compiled (csrc/sm90/prefill/sparse/
// instantiations/phase1_k576{,_topklen}.cu); the other entry points of the interface raise AttributeError.

#include <optional>
#include <limits>
#include <vector>

#include <cuda_runtime_api.h>
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

namespace {

constexpr int kDqk = 576;     // the only head dim compiled here (DeepSeek V3.2 / Kimi K3 latent)
constexpr int kDv = 512;      // the kernel's value dim
constexpr int kTopkBlock = 128;  // the kernel walks top-k in pairs of 64-key blocks (KU_ASSERT topk % 128 == 0)
constexpr float kLog2e = 1.44269504f;

int device_attribute(cudaDeviceAttr attr, int device) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
    return value;
}

int checked_int(int64_t v, const char* what) {
    // FlashMLA's params hold int strides/sizes: refuse what would wrap instead of reading the wrong rows.
    TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "flash_mla sparse_prefill_fwd: ", what,
                " = ", v, " does not fit in int32");
    return static_cast<int>(v);
}

std::vector<at::Tensor> sparse_prefill_fwd(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                                           double sm_scale, int64_t d_v,
                                           const std::optional<at::Tensor>& attn_sink,
                                           const std::optional<at::Tensor>& topk_length) {
    TORCH_CHECK(q.is_cuda() && kv.is_cuda() && indices.is_cuda(), "flash_mla sparse_prefill_fwd: q, kv, indices "
                "must be CUDA tensors");
    TORCH_CHECK(kv.device() == q.device() && indices.device() == q.device(),
                "flash_mla sparse_prefill_fwd: q, kv, indices on different devices");
    c10::cuda::CUDAGuard guard(q.device());
    const int device = q.get_device();
    const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
    const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
    TORCH_CHECK(major == 9 && minor == 0, "flash_mla sparse_prefill_fwd: this build has the sm90a kernel only; the "
                "device is sm", major, minor);

    TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && indices.dim() == 3, "flash_mla sparse_prefill_fwd: q [s_q, h_q, "
                "d_qk], kv [s_kv, h_kv, d_qk], indices [s_q, h_kv, topk]; got q.dim() = ", q.dim(), ", kv.dim() = ",
                kv.dim(), ", indices.dim() = ", indices.dim());
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16,
                "flash_mla sparse_prefill_fwd: q and kv must be bfloat16, got ", q.scalar_type(), " / ",
                kv.scalar_type());
    TORCH_CHECK(indices.scalar_type() == at::kInt, "flash_mla sparse_prefill_fwd: indices must be int32, got ",
                indices.scalar_type());

    const int s_q = checked_int(q.size(0), "s_q");
    const int h_q = checked_int(q.size(1), "h_q");
    const int d_qk = checked_int(q.size(2), "d_qk");
    const int s_kv = checked_int(kv.size(0), "s_kv");
    const int h_kv = checked_int(kv.size(1), "h_kv");
    const int topk = checked_int(indices.size(2), "topk");
    TORCH_CHECK(d_qk == kDqk && kv.size(2) == kDqk, "flash_mla sparse_prefill_fwd: this build has d_qk = 576 only, "
                "got q d_qk = ", d_qk, ", kv d_qk = ", kv.size(2));
    TORCH_CHECK(d_v == kDv, "flash_mla sparse_prefill_fwd: d_v must be 512, got ", d_v);
    TORCH_CHECK(h_kv == 1, "flash_mla sparse_prefill_fwd: the sm90 kernel takes one kv head, got ", h_kv);
    TORCH_CHECK(h_q == 64 || h_q == 128, "flash_mla sparse_prefill_fwd: h_q must be 64 or 128, got ", h_q);
    TORCH_CHECK(topk > 0 && topk % kTopkBlock == 0, "flash_mla sparse_prefill_fwd: topk must be a positive "
                "multiple of 128 on sm90, got ", topk);
    TORCH_CHECK(indices.size(0) == s_q && indices.size(1) == h_kv, "flash_mla sparse_prefill_fwd: indices must be [",
                s_q, ", ", h_kv, ", topk], got ", indices.sizes());
    TORCH_CHECK(q.stride(2) == 1 && kv.stride(2) == 1 && indices.stride(2) == 1,
                "flash_mla sparse_prefill_fwd: q, kv, indices need a contiguous last dimension");
    // The attention sink is FlashMLA API surface that titan_kimi does not use; kept for signature parity.
    if (attn_sink.has_value()) {
        TORCH_CHECK(attn_sink->is_cuda() && attn_sink->scalar_type() == at::kFloat && attn_sink->dim() == 1 &&
                    attn_sink->size(0) == h_q && attn_sink->stride(0) == 1,
                    "flash_mla sparse_prefill_fwd: attn_sink must be a contiguous float32 CUDA tensor [h_q]");
    }
    if (topk_length.has_value()) {
        TORCH_CHECK(topk_length->is_cuda() && topk_length->scalar_type() == at::kInt && topk_length->dim() == 1 &&
                    topk_length->size(0) == s_q && topk_length->stride(0) == 1,
                    "flash_mla sparse_prefill_fwd: topk_length must be a contiguous int32 CUDA tensor [s_q]");
    }

    auto opts = q.options();
    at::Tensor out = at::empty({s_q, h_q, kDv}, opts);
    at::Tensor lse = at::empty({s_q, h_q}, opts.dtype(at::kFloat));
    at::Tensor max_logits = at::empty({s_q, h_q}, opts.dtype(at::kFloat));
    if (s_q == 0) {
        return {out, max_logits, lse};
    }

    const float scale = static_cast<float>(sm_scale);
    SparseAttnFwdParams params = {
        s_q, s_kv, h_q, h_kv, d_qk, kDv, topk,
        scale, scale * kLog2e,
        reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr()),
        reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr()),
        indices.data_ptr<int>(),
        attn_sink.has_value() ? attn_sink->data_ptr<float>() : nullptr,
        topk_length.has_value() ? topk_length->data_ptr<int>() : nullptr,
        checked_int(q.stride(0), "q.stride(0)"), checked_int(q.stride(1), "q.stride(1)"),
        checked_int(kv.stride(0), "kv.stride(0)"), checked_int(kv.stride(1), "kv.stride(1)"),
        checked_int(indices.stride(0), "indices.stride(0)"), checked_int(indices.stride(1), "indices.stride(1)"),
        reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr()),
        max_logits.data_ptr<float>(),
        lse.data_ptr<float>(),
        device_attribute(cudaDevAttrMultiProcessorCount, device),
        c10::cuda::getCurrentCUDAStream(device).stream(),
    };
    if (topk_length.has_value()) {
        sm90::fwd::run_fwd_phase1_kernel<kDqk, true>(params);
    } else {
        sm90::fwd::run_fwd_phase1_kernel<kDqk, false>(params);
    }
    return {out, max_logits, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA sm90 sparse prefill forward only (titan_kimi's minimal build)";
    m.def("sparse_prefill_fwd", &sparse_prefill_fwd, "FlashMLA sparse prefill forward (sm90a, d_qk 576, d_v 512)",
          pybind11::arg("q"), pybind11::arg("kv"), pybind11::arg("indices"), pybind11::arg("sm_scale"),
          pybind11::arg("d_v"), pybind11::arg("attn_sink"), pybind11::arg("topk_length"));
}
