"""MXFP4 decode against hand-computed values and a per-element reference; the encoder's rounding."""

from __future__ import annotations

import math

import pytest
import torch

from titan_kimi.checkpoint.mxfp4 import E2M1_VALUES, decode_mxfp4, encode_mxfp4


def row(byte: int, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of 32 elements: 16 copies of ``byte`` and one scale."""
    return torch.full((1, 16), byte, dtype=torch.uint8), torch.tensor([[scale]], dtype=torch.uint8)


def reference_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element by element, straight from spec §9.4."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2)
    for o in range(packed.shape[0]):
        for j in range(packed.shape[1]):
            byte = int(packed[o, j])
            for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                out[o, k] = E2M1_VALUES[code] * 2.0 ** (int(scale[o, k // 32]) - 127)
    return out


@pytest.mark.parametrize(
    "byte, scale, expected",
    [
        (0x10, 127, [0.0, 0.5]),  # the spec's example: low nibble 0 -> 0.0, high nibble 1 -> 0.5
        (0x72, 127, [1.0, 6.0]),
        (0x9F, 127, [-6.0, -0.5]),  # negative codes: 0xF = -6, 0x9 = -0.5
        (0xC8, 127, [-0.0, -2.0]),
        (0x9F, 128, [-12.0, -1.0]),  # scale 128: x2
        (0x9F, 126, [-3.0, -0.25]),  # scale 126: x0.5
        (0x35, 130, [24.0, 12.0]),  # 3 * 8, 1.5 * 8
        (0x01, 0, [2.0**-128, 0.0]),  # the smallest scale, 2^-127, times 0.5
    ],
)
def test_hand_computed_values(byte, scale, expected):
    values = decode_mxfp4(*row(byte, scale))[0]
    assert values[:2].tolist() == expected
    assert torch.equal(values, torch.tensor(expected * 16))
    if expected[0] == 0.0 and byte & 0x8:
        assert math.copysign(1.0, values[0].item()) == -1.0  # code 8 is -0


def test_scale_255_is_nan():
    assert torch.isnan(decode_mxfp4(*row(0x22, 255))).all()


def test_matches_the_per_element_reference_across_groups():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8, generator=g)  # 96 inputs = 3 groups
    scale = torch.randint(110, 140, (5, 3), dtype=torch.uint8, generator=g)
    assert torch.equal(decode_mxfp4(packed, scale), reference_decode(packed, scale))


def test_decodes_straight_into_a_strided_bf16_slice():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(120, 134, (4, 2), dtype=torch.uint8, generator=g)
    dest = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    out = decode_mxfp4(packed, scale, out=dest[1, 2:6])
    assert out.data_ptr() == dest[1, 2:6].data_ptr()
    assert torch.equal(dest[1, 2:6].float(), reference_decode(packed, scale))  # exact in bf16
    assert dest[0].abs().sum() == 0 and dest[1, :2].abs().sum() == 0 and dest[2].abs().sum() == 0
    column_view = torch.zeros(64, 4).t()  # not flattenable: decoded whole, then copied
    decode_mxfp4(packed, scale, out=column_view)
    assert torch.equal(column_view, reference_decode(packed, scale))


def test_shape_and_dtype_errors():
    packed, scale = row(0x11, 127)
    with pytest.raises(ValueError, match=r"packed \[1, 16\] needs scale \[1, 1\].*got \[1, 2\]"):
        decode_mxfp4(packed, torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed weights must be uint8"):
        decode_mxfp4(packed.int(), scale)
    with pytest.raises(ValueError, match="scale must be uint8"):
        decode_mxfp4(packed, scale.float())
    with pytest.raises(ValueError, match=r"out has shape \[1, 16\], expected \[1, 32\]"):
        decode_mxfp4(packed, scale, out=torch.empty(1, 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="NaN or inf"):
        encode_mxfp4(torch.full((1, 32), float("inf")))


def test_encoder_hand_examples():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([0.5, 6.0, -1.5, 0.0])
    packed, scale = encode_mxfp4(w)
    assert scale.tolist() == [[127]]  # max |w| = 6 fits scale 2^0 exactly
    assert packed[0, :2].tolist() == [0x71, 0x0B]  # (0.5 -> 1, 6 -> 7), (-1.5 -> 0xB, 0 -> 0)
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 12.0, -0.75  # max 12 needs scale 2^1: 12/2 = 6 (code 7), -0.375 rounds to -0.5 (code 9)
    packed, scale = encode_mxfp4(w)
    assert scale.tolist() == [[128]] and packed[0, 0].item() == 0x97
    assert encode_mxfp4(torch.zeros(1, 32))[1].tolist() == [[127]]


def test_encoder_rounds_to_nearest_even_on_the_grid():
    # Midpoints between grid neighbours at scale 1 (a 6.0 entry fixes the scale): ties go to the even code.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0
    w[0, 1:8], w[0, 8:15] = ties, -ties
    packed, scale = encode_mxfp4(w)
    decoded = decode_mxfp4(packed, scale)[0]
    assert torch.equal(decoded[1:8], expected) and torch.equal(decoded[8:15], -expected)


def test_encode_decode_error_bound_and_idempotence():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)) * 3
    packed, scale = encode_mxfp4(w)
    decoded = decode_mxfp4(packed, scale)
    group_max = w.view(16, 4, 32).abs().amax(-1, keepdim=True)
    # The largest grid step is 2 (between 4 and 6) at a scale of at most group_max / 3: error <= group_max / 3.
    assert ((decoded - w).view(16, 4, 32).abs() <= group_max / 3 + 1e-6).all()
    assert torch.equal(decode_mxfp4(*encode_mxfp4(decoded)), decoded)  # grid values re-encode exactly
