"""Where and in which precision the local engine computes: ``engine.local.device`` and
``engine.local.dtype`` resolved to torch objects."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` = cuda when available, else cpu; ValueError for an unusable name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"engine.local.device: {name!r} is not a torch device") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.local.device is {name!r} but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"engine.local.device must be auto, cpu or cuda, got {name!r}")
    return device
