from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels import cpu


class SiluAndMul(nn.Module):
    """silu(gate) * up over the stacked [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and cpu.supports(x):
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
