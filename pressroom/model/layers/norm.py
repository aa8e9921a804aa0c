from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels import cpu


class RMSNorm(nn.Module):
    """RMSNorm (accumulated in fp32 by the fused kernel), with the residual add fused in when one is given."""

    batch_invariant = False  # set at load under --batch-invariant (model/batch_invariant.py)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.batch_invariant:
            return self._forward_rows(x, residual)
        if x.is_cuda and x.dim() == 2 and x.is_contiguous():
            return self._forward_triton(x, residual)
        if x.dim() == 2 and x.is_contiguous() and cpu.supports(x, self.weight):
            return self._forward_c(x, residual)
        if residual is None and cpu.supports(x, self.weight):  # per-head norms: each head a row of the kernel
            return self._forward_rows(x, None)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual

    def _forward_rows(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Always a kernel that normalises each row alone (torch's reduction may split a row when there are
        few); x [..., hidden] (Qwen3's per-head norms: strided views) as contiguous rows."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        out = self._forward_triton(x, residual) if x.is_cuda else self._forward_c(x, residual)
        if residual is None:
            return out.view(shape)
        return out[0].view(shape), out[1].view(shape)

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
