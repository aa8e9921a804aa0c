"""Rotary position embedding in place, NeoX / HF rotate_half layout (the two halves of the rotary dims pair up)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_HEADS_PER_PROGRAM = 16


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st, num_heads,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = (heads < num_heads)[:, None] & col_ok[None, :]
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotates the first rotary_dim dims of every head of x [T, heads, head_dim] in place (row stride free, so
    the q and k heads of a fused qkv go in one call); cos, sin: fp32 [T, rotary_dim // 2]. Returns x.
    Reference: RotaryEmbedding.rotate_reference."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_ needs unit stride in head_dim and an even rotary_dim <= {head_dim}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.shape[-1] != rotary_dim // 2:
        raise ValueError(f"cos and sin must be [tokens, {rotary_dim // 2}] with unit column stride")
    if num_tokens == 0:
        return x
    block_h = min(triton.next_power_of_2(num_heads), _HEADS_PER_PROGRAM)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), num_heads,
        HALF=rotary_dim // 2, HALF_PAD=triton.next_power_of_2(rotary_dim // 2), BLOCK_H=block_h, num_warps=4)
    return x
