"""The image processor: grid sizes, patch order and normalisation, bad images."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from titan_kimi.data.image_processor import ImageProcessor, open_image


# Sides round to the nearest multiple of 28 (patch 14 x merge 2); then the area is brought within
# [min_pixels, max_pixels] = [56^2, 896^2] by scaling both sides together (ceil when growing, floor when shrinking).
@pytest.mark.parametrize("width, height, grid", [
    (57, 31, (1, 4, 6)),  # 56 x 28 = 1,568 < 3,136: beta = sqrt(3136 / 1767) = 1.332 -> ceil(2.71), ceil(1.47) -> 84 x 56
    (43, 99, (1, 8, 4)),  # 43 -> 56 (1.54 rounds to 2), 99 -> 112 (3.54 rounds to 4); 6,272 pixels: kept
    (30, 20, (1, 4, 6)),  # 28 x 28 < 3,136: beta = sqrt(3136 / 600) = 2.286 -> ceil(2.45), ceil(1.63) -> 84 x 56
    (1001, 501, (1, 36, 72)),  # 1008 x 504 = 508,032 <= 802,816: kept
    (2001, 1001, (1, 44, 90)),  # 1988 x 1008 too big: beta = 1.5796 -> floor(45.2), floor(22.6) -> 1260 x 616
    (5, 700, (1, 50, 2)),  # 5 -> at least 28; 700 = 25 x 28; 19,600 pixels: kept
])
def test_grid_sizes_for_odd_image_sizes(width, height, grid):
    processor = ImageProcessor()
    assert processor.grid_for_size(width, height) == grid
    t, h, w = grid
    assert h % 2 == 0 and w % 2 == 0
    assert processor.tokens_for_grid(grid) == (h // 2) * (w // 2)
    image = Image.new("RGB", (width, height), (10, 20, 30))
    processed = processor(image)
    assert processed.grid_thw == grid and processed.pixel_values.shape == (t * h * w, 3, 14, 14)


def test_patches_are_raster_ordered_and_normalised():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)  # already a multiple of 28: no resize
    processed = ImageProcessor()(Image.fromarray(pixels))
    assert processed.grid_thw == (1, 4, 6)
    normalised = (pixels.astype(np.float32) / 255 - 0.5) / 0.5
    for index in range(24):
        r, c = divmod(index, 6)
        expected = torch.from_numpy(normalised[14 * r : 14 * r + 14, 14 * c : 14 * c + 14].transpose(2, 0, 1).copy())
        assert torch.allclose(processed.pixel_values[index], expected)


def test_greyscale_and_rgba_become_rgb():
    grey = ImageProcessor()(Image.new("L", (28, 28), 255))
    assert grey.pixel_values.shape[1] == 3 and torch.allclose(grey.pixel_values, torch.ones(1))
    rgba = ImageProcessor()(Image.new("RGBA", (56, 56), (0, 0, 0, 0)))
    assert torch.allclose(rgba.pixel_values, -torch.ones(1))


def test_bad_images_are_rejected_naming_the_source(tmp_path):
    processor = ImageProcessor(max_input_pixels=10_000)
    with pytest.raises(ValueError, match=r"rows\.parquet row 3: unreadable image"):
        open_image(b"definitely not an image", "rows.parquet row 3")
    with pytest.raises(ValueError, match="row 4: the image has no data"):
        open_image(b"", "row 4")
    with pytest.raises(ValueError, match="row 5: zero-size image"):
        processor.grid_for_size(0, 40, where="row 5")
    with pytest.raises(ValueError, match=r"row 6: too many pixels \(101 x 100"):
        processor(Image.new("RGB", (101, 100)), where="row 6")
    with pytest.raises(ValueError, match="not found"):
        open_image(str(tmp_path / "missing.png"), "row 7")
    with pytest.raises(ValueError, match="too extreme"):
        ImageProcessor(max_input_pixels=10**9).grid_for_size(1, 30_000, where="row 8")
    truncated = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(truncated, "PNG")
    with pytest.raises(ValueError, match="row 9: unreadable image"):
        processor(open_image(truncated.getvalue()[:200], "row 9"), "row 9")


def test_invalid_bounds_are_rejected():
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessor(min_pixels=100, max_pixels=50)
    with pytest.raises(ValueError, match="one merge window"):
        ImageProcessor(min_pixels=1, max_pixels=700)
