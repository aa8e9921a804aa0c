"""NVFP4 weights: E2M1 values (kernels/mxfp4.py's, packed the same way: two per byte, the even input in the low
nibble) in blocks of 16 inputs, each block scaled by an FP8 e4m3 value, the whole tensor by one fp32 global scale
(ModelOpt's `weight_scale_2`). A layer keeps the global scale per row (`[rows]`), so stacked parts quantized apart
(q, k, v of a checkpoint) keep their own; `[1]` serves every row.

The torch functions here are the reference the Triton kernel (kernels/triton/quant_gemv.py) is tested against.
"""
from __future__ import annotations

import torch

from pressroom.kernels import mxfp4

BLOCK = 16  # inputs per block scale
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def check_shape(cols: int) -> None:
    if cols % BLOCK:
        raise ValueError(f"NVFP4 quantizes rows in blocks of {BLOCK} inputs; a weight with {cols} inputs (per rank) "
                         f"is not a whole number of blocks. Leave this model's --quantization at auto.")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (packed E2M1 uint8 [rows, cols / 2], FP8 block scales [rows, cols / 16], fp32 global
    scale [1]).

    NVIDIA's recipe: the global scale maps the tensor's largest magnitude to FP8's largest block scale times
    E2M1's 6; each block's scale (its largest magnitude / 6, over the global scale) is rounded to FP8; values,
    divided by both, round to the nearest E2M1 value and clip at 6 (a block scale rounded down makes the block's
    largest magnitude up to 1/16 too large for 6)."""
    rows, cols = w.shape
    check_shape(cols)
    w = w.float()
    global_scale = (w.abs().amax().clamp(min=1e-12) / (FP8_MAX * mxfp4.E2M1_MAX)).reshape(1)
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    block_scale = (blocks.abs().amax(dim=-1) / mxfp4.E2M1_MAX / global_scale).clamp(max=FP8_MAX).to(FP8)
    divisor = block_scale.float().unsqueeze(-1) * global_scale
    scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks)).clamp(-mxfp4.E2M1_MAX,
                                                                                         mxfp4.E2M1_MAX)
    return mxfp4.pack_e2m1(scaled.reshape(rows, cols)), block_scale, global_scale


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> [rows, cols] in `dtype`: each E2M1 value times its block's scale times the global scale (in fp32;
    `global_scale` [1] or one per row)."""
    scale = (block_scale.float() * global_scale.float().reshape(-1, 1)).repeat_interleave(BLOCK, dim=1)
    return (mxfp4.unpack_e2m1(packed) * scale).to(dtype)


def reference(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] times the NVFP4 weight [out, in], dequantized to x's dtype (weight-only)."""
    return torch.nn.functional.linear(x, dequantize(packed, block_scale, global_scale, x.dtype), bias)
