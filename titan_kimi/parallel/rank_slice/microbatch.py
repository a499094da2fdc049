"""One pipeline microbatch as a stage receives it, with the recipe's row layout: padded rows (one example then
padding, as the hellaswag and medpix datasets make them; medpix rows carry one image) or packed rows (documents
tiling the row, as packed_text makes them).

Token ids, pixels and hidden states are random (their values do not change the compute); the segment layout
(``doc_ids``, which decides every varlen kernel's work) and the image grid are the recipe's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_kimi.data.batch import IGNORE_INDEX
from titan_kimi.parallel.pipeline_images import ImageSlots

ROW_FORMS = "padded:<valid tokens>, packed:<documents>, or medpix:<text tokens>:<image height>x<image width>"


@dataclass(frozen=True)
class RowLayout:
    """What one row of ``seq_len`` holds. ``kind``: padded | packed | medpix. padded: ``valid`` tokens of one
    example, then padding; packed: ``documents`` documents of (nearly) equal length; medpix: one image of
    ``image`` pixels (height, width), expanded to its merged tokens, and ``valid`` text tokens, then padding."""

    kind: str
    valid: int = 0
    documents: int = 1
    image: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.kind == "packed":
            return f"packed rows of {self.documents} documents"
        if self.kind == "medpix":
            return f"padded medpix rows: one {self.image[0]}x{self.image[1]} image + {self.valid} text tokens"
        return f"padded rows of {self.valid} valid tokens"


def parse_rows(spec: str) -> RowLayout:
    kind, _, rest = spec.partition(":")
    try:
        if kind == "padded":
            return RowLayout("padded", valid=int(rest))
        if kind == "packed":
            return RowLayout("packed", documents=int(rest))
        if kind == "medpix":
            text, _, size = rest.partition(":")
            h, _, w = size.partition("x")
            return RowLayout("medpix", valid=int(text), image=(int(h), int(w)))
    except ValueError:
        pass
    raise ValueError(f"row layout {spec!r}: valid: {ROW_FORMS}")


# The recipes' datasets, as stated defaults: HellaSwag items are a context and one ending (~100-150 tokens);
# MedPix-VQA scans are scaled to at most the processor's 896 x 896 (1,024 merged image tokens) with a short
# question and answer.
DEFAULT_ROWS = {"hellaswag": "padded:128", "medpix": "medpix:128:896x896", "packed_text": "packed:4",
                "synthetic": "packed:1"}


def image_grid(image: tuple[int, int], patch: int, merge: tuple[int, int]) -> tuple[int, int, int]:
    """``(t, h, w)`` patches of an image of ``image`` pixels, each side rounded to whole merge windows (the
    processor's resize without its pixel bounds)."""
    unit_h, unit_w = patch * merge[0], patch * merge[1]
    h = max(1, round(image[0] / unit_h)) * merge[0]
    w = max(1, round(image[1] / unit_w)) * merge[1]
    return 1, h, w


def doc_ids_for(layout: RowLayout, seq_len: int, image_tokens: int = 0) -> torch.Tensor:
    """``[seq_len]`` int32 doc ids of one row: 1.. on documents, 0 on padding."""
    ids = torch.zeros(seq_len, dtype=torch.int32)
    if layout.kind == "packed":
        if not 1 <= layout.documents <= seq_len:
            raise ValueError(f"packed rows: {layout.documents} documents do not fit in {seq_len} tokens")
        bounds = torch.linspace(0, seq_len, layout.documents + 1).round().long()
        for d in range(layout.documents):
            ids[bounds[d]:bounds[d + 1]] = d + 1
        return ids
    valid = layout.valid + image_tokens
    if not 1 <= valid <= seq_len:
        raise ValueError(f"{layout.describe()}: {valid} valid tokens do not fit in rows of {seq_len}")
    ids[:valid] = 1
    return ids


@dataclass
class Microbatch:
    """A stage's positional inputs and the schedule's keyword inputs for one microbatch."""

    inputs: tuple[torch.Tensor, ...]
    doc_ids: torch.Tensor
    labels: torch.Tensor
    grids: list[tuple[int, int, int]]  # the images' patch grids (for their FLOPs)

    @property
    def tokens(self) -> int:
        return self.doc_ids.numel()


def make_microbatch(part, layout: RowLayout, rows: int, seq_len: int, device: torch.device,
                    dtype: torch.dtype, generator: torch.Generator) -> Microbatch:
    """The inputs of stage ``part`` (a ``KimiK3Model`` / ``KimiK3VLModel`` stage) for ``rows`` rows."""
    args = part.args
    vision = getattr(part, "vision_args", None)
    grids, image_tokens = [], 0
    if layout.kind == "medpix":
        if vision is None:
            raise ValueError("medpix rows need an image-text model (model.vision_flavor)")
        grid = image_grid(layout.image, vision.patch_size, vision.merge_kernel)
        image_tokens = grid[1] // vision.merge_kernel[0] * (grid[2] // vision.merge_kernel[1])
        grids = [grid] * rows
    row = doc_ids_for(layout, seq_len, image_tokens)
    doc_ids = row.expand(rows, seq_len).contiguous()
    labels = torch.randint(0, args.vocab_size, (rows, seq_len), generator=generator)
    labels[doc_ids == 0] = IGNORE_INDEX
    if part.is_first:
        tokens = torch.randint(1, args.vocab_size, (rows, seq_len), generator=generator)
        inputs: tuple[torch.Tensor, ...] = (tokens,)
        if grids:
            rest = tokens[:, 1:]
            rest[rest == part.placeholder_id] = 1  # one placeholder per row only:
            tokens[:, 0] = part.placeholder_id  # the image first, as the chat template puts it
            t, h, w = grids[0]
            pixels = torch.randn(rows * t * h * w, 3, vision.patch_size, vision.patch_size, generator=generator)
            slots = ImageSlots(part.placeholder_id, max_images=1, max_patches=t * h * w)
            inputs += slots.pad(tokens, pixels, torch.tensor(grids, dtype=torch.int64))
    else:
        m = part.first_layer // args.attn_res_block_size if args.attn_res_block_size else 0
        hidden = torch.randn(rows, seq_len, args.dim, generator=generator)
        bank = torch.randn(rows * seq_len, m, args.dim, generator=generator)
        inputs = (hidden.to(dtype), bank.to(dtype))
    moved = tuple(x.to(device).requires_grad_(x.is_floating_point() and not part.is_first) for x in inputs)
    return Microbatch(moved, doc_ids.to(device), labels.to(device), grids)
