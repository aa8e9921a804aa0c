from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels import batch_invariant as invariant


class SiluAndMul(nn.Module):
    """silu(gate) * up over the stacked [gate | up] projection."""

    batch_invariant = False  # set at load under --batch-invariant (model/batch_invariant.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.silu_and_mul(x)
        if x.is_cuda and x.is_contiguous():
            from pressroom.kernels.triton.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up over the stacked [gate | up] projection (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
