from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as HF does), with the residual add fused in when one is given."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        y = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight
        return y if residual is None else (y, residual)
