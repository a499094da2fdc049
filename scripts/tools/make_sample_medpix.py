"""Writes the image-text sample shipped in titan_kimi/assets/data/sample_medpix/: python scripts/tools/make_sample_medpix.py

    python scripts/tools/make_sample_medpix.py [--out-dir titan_kimi/assets/data/sample_medpix]

Every image is drawn here (numpy + Pillow, nothing downloaded): a grey body outline on a dark field with a
bright round "lesion" in one quadrant (or none), in a "CT" (dark, fine grain) or "MRI" (brighter, smooth)
style, at odd and even sizes between 42 and 126 pixels so the processor's resizing is exercised. Each image
gets two questions (where is the lesion / which modality), with templated answers that the image decides,
so a tiny image-text model can learn them. Outputs are deterministic (the same bytes on every run):

- ``images/scan_NNN.png`` (8-bit greyscale);
- ``sample_medpix.jsonl``: ``{"image": "images/scan_NNN.png", "question": ..., "answer": ..., "case_id": ...}``;
- the validation split: ``images/val_scan_NNN.png`` and ``sample_medpix_validation.jsonl`` (other scans, drawn
  from a generator of their own, so no image or row of the training split is in it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "titan_kimi" / "assets" / "data" / "sample_medpix"
SEED = 20260216
VALIDATION_SEED = 20260217
NUM_IMAGES = 48
NUM_VALIDATION_IMAGES = 12
SIDES = (42, 56, 61, 70, 84, 93, 98, 112, 126)
QUADRANTS = ("upper left", "upper right", "lower left", "lower right")
WHERE_QUESTIONS = ("Where is the lesion in this image?", "In which quadrant is the abnormality located?")
MODALITY_QUESTIONS = ("What imaging modality was used?", "Is this a CT or an MRI scan?")


def draw_scan(rng: np.random.Generator, width: int, height: int, quadrant: int | None, modality: str) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    cx, cy = width / 2, height / 2
    body = ((x - cx) / (0.45 * width)) ** 2 + ((y - cy) / (0.45 * height)) ** 2 <= 1.0
    base, tissue = (20.0, 110.0) if modality == "CT" else (60.0, 170.0)
    img = np.where(body, tissue, base).astype(np.float32)
    img += 25.0 * np.sin(x / max(width, 1) * 3.1) * body  # a smooth density gradient across the body
    if quadrant is not None:
        qx = cx + (-0.22 if quadrant in (0, 2) else 0.22) * width
        qy = cy + (-0.22 if quadrant in (0, 1) else 0.22) * height
        radius = 0.09 * min(width, height) + 2
        img[(x - qx) ** 2 + (y - qy) ** 2 <= radius**2] = 245.0
    if modality == "CT":
        img += rng.integers(-6, 7, size=img.shape) * 1.0
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), mode="L")


def write_split(out: Path, rng: np.random.Generator, count: int, prefix: str, jsonl: str) -> int:
    rows = []
    for i in range(count):
        width, height = int(rng.choice(SIDES)), int(rng.choice(SIDES))
        quadrant = None if i % 5 == 4 else int(rng.integers(4))
        modality = "CT" if rng.random() < 0.5 else "MRI"
        name = f"images/{prefix}scan_{i:03d}.png"
        draw_scan(rng, width, height, quadrant, modality).save(out / name, optimize=True)
        where = (f"The lesion is in the {QUADRANTS[quadrant]} quadrant." if quadrant is not None
                 else "No lesion is visible in this image.")
        case = f"{prefix}case{i:03d}"
        rows.append({"image": name, "question": WHERE_QUESTIONS[i % 2], "answer": where, "case_id": case})
        rows.append({"image": name, "question": MODALITY_QUESTIONS[i % 2],
                     "answer": f"This is an {modality} image." if modality == "MRI" else "This is a CT image.",
                     "case_id": case})
    with open(out / jsonl, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    out = parser.parse_args().out_dir
    (out / "images").mkdir(parents=True, exist_ok=True)
    train = write_split(out, np.random.default_rng(SEED), NUM_IMAGES, "", "sample_medpix.jsonl")
    val = write_split(out, np.random.default_rng(VALIDATION_SEED), NUM_VALIDATION_IMAGES, "val_",
                      "sample_medpix_validation.jsonl")
    print(f"wrote {train} training rows ({NUM_IMAGES} images) and {val} validation rows "
          f"({NUM_VALIDATION_IMAGES} images) to {out}")


if __name__ == "__main__":
    main()
