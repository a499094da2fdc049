"""The config's dtype names (``"bfloat16"``, ``"float32"``) as torch dtypes."""

import torch

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
