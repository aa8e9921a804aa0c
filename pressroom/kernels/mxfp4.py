"""MXFP4 weights (OCP microscaling): blocks of 32 consecutive inputs of a row share one E8M0 scale (a power of two,
stored as its biased exponent in a byte), each value is E2M1 (sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6), packed two per byte, the even input in the low nibble (gpt-oss's `*_blocks` layout).

The torch functions here are the reference: `quantize` (online quantization at load), `dequantize` and
`reference` (dequantize, then multiply in the activations' dtype), which the Triton kernel
(kernels/triton/quant_gemv.py) is tested against.
"""
from __future__ import annotations

import torch

BLOCK = 32  # inputs per scale
E8M0_BIAS = 127
E2M1_MAX = 6.0
# the magnitudes of codes 0..7; code | 8 is the negative value
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def check_shape(cols: int) -> None:
    if cols % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows in blocks of {BLOCK} inputs; a weight with {cols} inputs (per rank) "
                         f"is not a whole number of blocks. Leave this model's --quantization at auto.")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (packed E2M1 uint8 [rows, cols / 2], E8M0 scales uint8 [rows, cols / 32]).

    Each block's scale is the smallest power of two that brings its largest magnitude within E2M1's 6 (so no
    value clips, unlike the OCP recipe's floor(log2(amax)) - 2, which clips up to a third of the largest
    magnitudes); values round to the nearest E2M1 value (ties to the smaller magnitude)."""
    rows, cols = w.shape
    check_shape(cols)
    blocks = w.float().reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    packed = pack_e2m1((blocks / torch.exp2(exponent)).reshape(rows, cols))
    return packed, (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def pack_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Values within [-6, 6] [rows, cols] -> the nearest E2M1 codes (ties to the smaller magnitude), two per byte
    [rows, cols / 2], the even input in the low nibble."""
    codes = torch.bucketize(scaled.abs(), _MIDPOINTS.to(scaled.device)).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [rows, cols / 2] -> their values in fp32 [rows, cols]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return torch.cat([E2M1_VALUES, -E2M1_VALUES]).to(packed.device)[codes]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed E2M1 [rows, cols / 2] with E8M0 scales [rows, cols / 32] -> [rows, cols] in `dtype` (exact: every
    value is a power of two times one of E2M1's)."""
    scale = torch.exp2(scales.float() - E8M0_BIAS).repeat_interleave(BLOCK, dim=1)
    return (unpack_e2m1(packed) * scale).to(dtype)


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] times the MXFP4 weight [out, in]: dequantized to x's dtype, then F.linear (weight-only:
    the activations are not quantized)."""
    return torch.nn.functional.linear(x, dequantize(packed, scales, x.dtype), bias)
