"""The image processor: an image -> ``pixel_values [L, 3, 14, 14]`` and its ``(t, h, w)`` patch grid (spec §10.1).

The sources fix the tensor contract but not the preprocessing (spec §10.1, §15: resize policy, normalisation
and pixel bounds are UNKNOWN). Our choices:

- Resize (bicubic) to a size whose sides are multiples of ``patch_size x merge`` (28 pixels), so the patch
  grid is even and every 2 x 2 window is whole: each side is rounded to the nearest multiple, then both are
  scaled down (up) together, keeping the aspect ratio, while the area is above ``max_pixels`` (below
  ``min_pixels``). The default ``max_pixels`` is the learned position grid's native 64 x 64 patches.
- Normalise RGB to ``(x / 255 - 0.5) / 0.5`` (MoonViT's mean and std).
- Patchify in raster order (row, then column); one frame (t = 1) per image.

Bad images are rejected with a ValueError naming where they came from (file, row): unreadable data, a zero
width or height, more than ``max_input_pixels`` before resizing (a decompression-bomb guard), or a shape so
extreme that one side would exceed the tower's rotary table.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 896 * 896  # 64 x 64 patches: the position grid's native size, 1,024 merged tokens
DEFAULT_MAX_INPUT_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold
MAX_GRID_SIDE = 512  # the tower's 2-D rotary table (spec §10.2)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [t*h*w, 3, p, p] float32
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def open_image(source: Any, where: str) -> Image.Image:
    """A lazily-decoded PIL image from a path, bytes, a ``{"bytes", "path"}`` dict (the Hugging Face ``Image``
    feature) or a PIL image; ``where`` names the source in errors (e.g. ``"data.parquet row 7"``)."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            source = source["bytes"]
        elif source.get("path"):
            source = source["path"]
        else:
            raise ValueError(f"{where}: the image is an empty record (neither 'bytes' nor 'path'): {source!r}")
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            if not len(source):
                raise ValueError(f"{where}: the image has no data (0 bytes)")
            return Image.open(io.BytesIO(bytes(source)))
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"{where}: image file {str(path)!r} not found")
            return Image.open(path)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"{where}: unreadable image ({err})") from None
    raise ValueError(f"{where}: an image must be a path, bytes or a {{'bytes', 'path'}} record, "
                     f"got {type(source).__name__}")


class ImageProcessor:
    def __init__(
        self,
        *,
        patch_size: int = 14,
        merge_kernel: tuple[int, int] = (2, 2),
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
        mean: tuple[float, float, float] = IMAGE_MEAN,
        std: tuple[float, float, float] = IMAGE_STD,
    ) -> None:
        self.patch_size = patch_size
        self.merge_kernel = tuple(merge_kernel)
        self.factors = (patch_size * self.merge_kernel[0], patch_size * self.merge_kernel[1])
        if min_pixels < 1 or max_pixels < min_pixels:
            raise ValueError(f"image pixel bounds min_pixels = {min_pixels}, max_pixels = {max_pixels} are invalid; "
                             f"valid: 1 <= min_pixels <= max_pixels")
        if max_pixels < self.factors[0] * self.factors[1]:
            raise ValueError(f"max_pixels = {max_pixels} is smaller than one merge window "
                             f"({self.factors[0]} x {self.factors[1]} pixels)")
        self.min_pixels, self.max_pixels, self.max_input_pixels = min_pixels, max_pixels, max_input_pixels
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    # ------------------------------------------------------------------ sizes
    def resized_size(self, width: int, height: int, where: str = "image") -> tuple[int, int]:
        """``(width, height)`` in pixels after resizing: multiples of the merge window, area within bounds."""
        if width < 1 or height < 1:
            raise ValueError(f"{where}: zero-size image ({width} x {height} pixels)")
        if width * height > self.max_input_pixels:
            raise ValueError(f"{where}: too many pixels ({width} x {height} = {width * height:,}; the limit is "
                             f"{self.max_input_pixels:,})")
        fh, fw = self.factors
        h = max(fh, round(height / fh) * fh)
        w = max(fw, round(width / fw) * fw)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(fh, math.floor(height / beta / fh) * fh)
            w = max(fw, math.floor(width / beta / fw) * fw)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / fh) * fh
            w = math.ceil(width * beta / fw) * fw
        if max(h, w) // self.patch_size > MAX_GRID_SIDE:
            raise ValueError(f"{where}: aspect ratio {width} x {height} is too extreme: a side would span more than "
                             f"{MAX_GRID_SIDE} patches")
        return w, h

    def grid_for_size(self, width: int, height: int, where: str = "image") -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of a ``width x height`` image."""
        w, h = self.resized_size(width, height, where)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        """Positions the image takes in the text sequence after the merge: ``(h/2)(w/2)``, whatever t."""
        _, h, w = grid
        return (h // self.merge_kernel[0]) * (w // self.merge_kernel[1])

    # ------------------------------------------------------------------ pixels
    def __call__(self, image: Image.Image, where: str = "image") -> ProcessedImage:
        width, height = image.size
        w, h = self.resized_size(width, height, where)
        try:
            rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # truncated or corrupt data surfaces on decode
            raise ValueError(f"{where}: unreadable image ({err})") from None
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
        pixels = (np.asarray(rgb, dtype=np.float32) / 255.0 - self.mean) / self.std  # [H, W, 3]
        p = self.patch_size
        gh, gw = h // p, w // p
        patches = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return ProcessedImage(torch.from_numpy(np.ascontiguousarray(patches)), (1, gh, gw))
