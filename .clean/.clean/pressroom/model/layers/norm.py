from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels import cpu


class RMSNorm(nn.Module):
    """RMSNorm (accumulated in fp32 by the fused kernel), with the residual add fused in when one is given."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and x.dim() == 2 and x.is_contiguous():
            return self._forward_triton(x, residual)
        if x.dim() == 2 and x.is_contiguous() and cpu.supports(x, self.weight):
            return self._forward_c(x, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual

    def _forward_c(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return cpu.rms_norm(x, self.weight, self.eps, None)
        residual = residual.contiguous()
        return cpu.rms_norm(x, self.weight, self.eps, residual), residual

    def _forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None):
        from pressroom.kernels.triton import norm
        if residual is None:
            return norm.rms_norm(x, self.weight, self.eps)
        return norm.fused_add_rms_norm(x, residual.contiguous(), self.weight, self.eps)
