"""The routed experts' grouped GEMM, in the compute dtype or (an opt-in, ``training.routed_expert_gemm``) in FP8.

``default``: ``torch._grouped_mm`` in the activations' dtype (an fp32 debug run under compile takes a masked
dense product instead, which compiled grouped_mm cannot take). ``fp8_rowwise``: torchao's FP8 grouped GEMM with
dynamic row-wise scales (``torchao.prototype.moe_training``): the activations are cast per row, the expert
weights per output column, and both backward GEMMs (input and weight gradients) run in FP8 too, accumulating in
fp32 and returning bf16. It needs an sm89+ GPU and every expert's row group a multiple of 16 rows
(``row_alignment``); the numbers against bf16 are in docs/perf.md.
"""

from __future__ import annotations

import torch

PRECISIONS = ("default", "fp8_rowwise")
_ROW_ALIGNMENT = {"default": 8, "fp8_rowwise": 16}  # bf16: 16-byte rows; FP8: the scaled grouped GEMM's groups


def row_alignment(precision: str) -> int:
    """Rows each expert's group is padded to a multiple of on CUDA."""
    _check(precision)
    return _ROW_ALIGNMENT[precision]


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"routed expert GEMM precision {precision!r} is not one of {PRECISIONS}")


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """None when ``fp8_rowwise`` can run on ``device``, else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"it needs a CUDA GPU with FP8 tensor cores (sm89 or newer); the job runs on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"it needs FP8 tensor cores (sm89 or newer); {name} is sm{capability[0]}{capability[1]}"
    try:
        import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
    except ImportError as err:
        return f"torchao's FP8 grouped GEMM does not import ({err}); pip install torchao"
    return None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, precision: str = "default") -> torch.Tensor:
    """Rows of expert ``e`` (``offsets``: cumulative int32 row counts) times ``w[e]`` ``[E, K, N]``."""
    if precision == "fp8_rowwise":
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        # the groups come padded to row_alignment("fp8_rowwise") by the caller (our alignment, or the EP permutation)
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w, offsets, out_dtype=torch.bfloat16,
                                                      pad_token_groups_for_grouped_mm=False)
    _check(precision)
    if x.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
        return torch._grouped_mm(x, w, offs=offsets)
    return _masked_mm(x, w, offsets)


def _masked_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM for dtypes the compiled grouped_mm rejects (fp32 debug runs): every expert multiplies
    every row and each row keeps its own expert's result. E times the work, but static shapes."""
    expert_of_row = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype),
                                       right=True)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        out = torch.where((expert_of_row == e).unsqueeze(1), x @ w[e], out)
    return out
