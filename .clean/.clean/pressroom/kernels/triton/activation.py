"""SiLU-and-mul over the stacked [gate | up] projection of a gated MLP."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> new tensor silu(x[:, :I]) * x[:, I:] of shape [T, I], computed in fp32."""
    num_tokens, double_width = x.shape
    if double_width % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs [tokens, 2 * I] with unit column stride, got {tuple(x.shape)}")
    width = double_width // 2
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, _BLOCK))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=_BLOCK, num_warps=4)
    return out
