"""Kernels whose result for a row does not depend on the rows beside it (`--batch-invariant`).

CUDA: linear layers go to the Triton matmul of kernels/triton/matmul.py (tiles from the weight's shape, no
split-K); the Triton SiLU-and-mul is elementwise and already invariant.

CPU: torch's GEMMs (MKL, oneDNN) block and thread by M, so a row's bits change with the batch (a row alone
and the same row among 2 differ for F.linear at every shape tried, and for prepacked oneDNN at K = 2048).
Every call here has the same shape instead: the rows go through in blocks of CPU_ROWS, the last one padded
with zeros, so each block is computed alike whatever M is. torch's vectorised SiLU computes a vector's
worth of elements with SLEEF's exp and a loop's tail with libm's, which round differently, and where a
tail falls depends on M and on how the threads split the tensor; `silu_and_mul` here uses only operations
that IEEE rounds the same in every lane (+, -, *, /, floor, shifts).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CPU_ROWS = 16  # rows per CPU GEMM call: decodes pay for at most 15 padding rows, prompts for a few calls more

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # Cephes' split of ln 2: k * _LN2_HI is exact
# Cephes expf's polynomial for exp(r) - 1 - r over |r| <= ln(2) / 2 (about 1 ulp in fp32)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), each row computed as it would be alone. `onednn`: the CPU's prepacked copy
    of the weight (then `weight` may be empty)."""
    if x.is_cuda:
        from pressroom.kernels.triton.matmul import invariant_matmul
        return invariant_matmul(x, weight, bias)
    if onednn is not None:
        return in_row_blocks(x, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, onednn, bias, "none", [], ""))
    return in_row_blocks(x, lambda rows: F.linear(rows, weight, bias))


def in_row_blocks(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over x's rows [..., K] in blocks of exactly CPU_ROWS rows (the last padded with zeros)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, -m % CPU_ROWS))
    out = torch.cat([fn(block) for block in padded.split(CPU_ROWS)]) if m else fn(padded[:0])
    return out[:m].reshape(*lead, out.shape[-1])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [..., gate | up]; on the CPU from exactly rounded operations only."""
    if x.is_cuda:
        from pressroom.kernels.triton.activation import silu_and_mul as triton_silu_and_mul
        return triton_silu_and_mul(x.contiguous())
    gate, up = x.float().chunk(2, dim=-1)
    return (gate / (1.0 + exp_exact(-gate)) * up).to(x.dtype)


def exp_exact(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp32 tensor as Cephes' expf computes it (2^k * poly(r)), in operations every SIMD lane and
    every scalar loop round alike; inputs are clamped to [-87, 88], where the result stays a normal float."""
    x = x.clamp(-87.0, 88.0)
    k = torch.floor(x * _LOG2E + 0.5)
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    p = torch.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + c
    y = p * (r * r) + r + 1.0
    two_k = torch.bitwise_left_shift(k.to(torch.int32) + 127, 23).view(torch.float32)
    return y * two_k
