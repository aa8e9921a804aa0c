"""Facts about the hardware pressroom runs on, read once (CPU tiers in cpu.py; CUDA's presence here)."""
from __future__ import annotations

import torch


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (asked without creating a CUDA context)."""
    return torch.cuda.is_available()
