from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.kernels import batch_invariant as invariant
from pressroom.kernels import cpu


class SiluAndMul(nn.Module):
    """silu(gate) * up over the stacked [gate | up] projection."""

    batch_invariant = False  # set at load under --batch-invariant (model/batch_invariant.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.silu_and_mul(x)
        if x.is_cuda and x.is_contiguous():
            from pressroom.kernels.triton.activation import silu_and_mul
            return silu_and_mul(x)
        if x.dim() == 2 and x.is_contiguous() and cpu.supports(x):  # the CPU decode stack's kernel
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up over the stacked [gate | up] projection (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and cpu.supports(x):  # the kernel Gemma 3's C decode stack runs
            return cpu.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
