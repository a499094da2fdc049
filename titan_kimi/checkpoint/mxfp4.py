"""MXFP4 (OCP microscaling FP4) as stored for the Kimi K3 routed experts (spec §9.4).

``packed [..., in/2]`` uint8 holds element 2j in the low nibble and 2j+1 in the high nibble; each nibble is an
E2M1 code (bit 3 = sign). ``scale [..., in/32]`` uint8 is an E8M0 exponent s with multiplier 2^(s-127), one per
group of 32 consecutive input elements.
"""

from __future__ import annotations

import math

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# 2^(s-127) for every scale byte, exact in fp32 (2^-127 is a subnormal); 0xFF is NaN in E8M0 (OCP MX v1.0).
_SCALES = torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)] + [math.nan], dtype=torch.float32)
# Rounding boundaries between neighbouring E2M1 magnitudes (codes 0..7).
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
# Decode in row chunks so the int64 codes and fp32 temporaries stay small whatever the tensor size.
_CHUNK_ELEMENTS = 1 << 22


def mxfp4_shapes(logical_shape: tuple[int, ...] | torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(packed_shape, scale_shape)`` of a tensor of ``logical_shape`` (last dim = input dim, a multiple of 32)."""
    *lead, cols = tuple(logical_shape)
    if cols % GROUP:
        raise ValueError(
            f"MXFP4 needs the input dimension to be a multiple of {GROUP}; got shape {list(logical_shape)}"
        )
    return (*lead, cols // 2), (*lead, cols // GROUP)


def _as_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)  # same bits: the E8M0 exponent byte
    raise ValueError(f"MXFP4 scale must be uint8 (E8M0 bytes); got {scale.dtype}")


def decode_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise ``packed [..., in/2]`` + ``scale [..., in/32]`` to ``[..., in]``.

    With ``out`` the values are written straight into it (any strides, any floating dtype; e.g. a slice of a
    model parameter), chunk by chunk, and ``out`` is returned. Values are exact in fp32 and bf16.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed weights must be uint8; got {packed.dtype}")
    scale = _as_scale_bytes(scale)
    if packed.dim() < 1 or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * GROUP:
        raise ValueError(
            f"MXFP4 shapes do not match: packed {list(packed.shape)} needs scale "
            f"{[*packed.shape[:-1], packed.shape[-1] * 2 // GROUP]} (one byte per {GROUP} elements); "
            f"got {list(scale.shape)}"
        )
    cols = packed.shape[-1] * 2
    shape = (*packed.shape[:-1], cols)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"decode_mxfp4: out has shape {list(out.shape)}, expected {list(shape)}")
    rows_p, rows_s = packed.reshape(-1, cols // 2), scale.reshape(-1, cols // GROUP)
    try:
        rows_out = out.view(-1, cols)
    except RuntimeError:  # a strided view that cannot be flattened: decode whole, then one copy
        out.copy_(decode_mxfp4(packed, scale, dtype=torch.float32))
        return out
    lut, scales = _LUT.to(packed.device), _SCALES.to(packed.device)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows_p.shape[0], step):
        p = rows_p[r0 : r0 + step]
        codes = torch.stack((p & 0x0F, p >> 4), dim=-1).view(p.shape[0], cols)  # low nibble first
        values = lut[codes.long()].view(p.shape[0], cols // GROUP, GROUP)
        values = values * scales[rows_s[r0 : r0 + step].long()].unsqueeze(-1)
        rows_out[r0 : r0 + step].copy_(values.view(p.shape[0], cols))
    return out


def _group_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax / 2^e <= 6 (so the largest element never clips), clamped to E8M0's [-127, 127]."""
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)  # amax/6 = m * 2^exponent, m in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    # amax/6 is rounded in fp32; step up where that rounding put the group just past the grid's end.
    e = torch.where(torch.ldexp(amax, -e.float()) > E2M1_MAX, e + 1, e)
    return e.clamp(-127, 127)


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [..., in]`` (in a multiple of 32) to ``(packed uint8 [..., in/2], scale uint8 [..., in/32])``.

    Per group of 32: the smallest power-of-two scale that fits the group's max |w| in [-6, 6], then
    round-to-nearest-even onto the E2M1 grid. Decoded values re-encode to the same values (the bytes may
    differ where two scales represent them).
    """
    if not weight.is_floating_point():
        raise ValueError(f"encode_mxfp4 needs a floating tensor; got {weight.dtype}")
    mxfp4_shapes(weight.shape)  # validates the input dimension
    w = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // GROUP, GROUP)
    if not torch.isfinite(w).all():
        raise ValueError("encode_mxfp4: the tensor holds NaN or inf, which MXFP4 cannot represent")
    e = _group_exponents(w.abs().amax(dim=-1))
    x = torch.ldexp(w, -e.float().unsqueeze(-1))
    mag = x.abs()
    mids = _MIDPOINTS.to(w.device)
    low = torch.bucketize(mag, mids, right=False)  # ties go to the smaller magnitude
    high = torch.bucketize(mag, mids, right=True)  # ties go to the larger one
    code = torch.where((low != high) & (high % 2 == 0), high, low)  # ties to the even code (mantissa bit 0)
    code = code | (torch.signbit(x).long() << 3)
    code = code.to(torch.uint8).reshape(*weight.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)
