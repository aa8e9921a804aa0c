"""FP8 (e4m3) GEMMs: y = dequant(x) @ dequant(w).T, both operands quantized with fp32 scales.

Scales cover groups of `group` consecutive inputs of a row: group = in_features is per-row (per token for
activations, per output channel for weights), 128 is DeepSeek's 1x128 activation groups against a weight's
128x128 blocks (stored here per row: [rows, ceil(in / 128)], each row holding its block's scale).

DeepSeek's checkpoints that declare `scale_fmt: "ue8m0"` were trained with power-of-two activation scales (each
group's amax / 448 rounded up to 2^k, what DeepGEMM's UE8M0 scales hold): `pow2_scales` quantizes that way.

Two paths compute the same sums: `scaled_mm` (torch._scaled_mm: FP8 tensor cores on Hopper, per-token x
per-channel scales applied to the fp32 accumulator) and `reference` (dequantize both, fp32 matmul), which
runs anywhere and is the oracle the other is tested against.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale, not a division by zero


def quantize(x: torch.Tensor, group: int, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (FP8 values [rows, cols], fp32 scales [rows, ceil(cols / group)]), each group
    scaled so its largest magnitude lands on FP8's largest value (`pow2_scales`: at or below it, the scale
    rounded up to a power of two)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = x if groups * group == cols else torch.nn.functional.pad(x, (0, groups * group - cols))
    blocks = padded.float().view(rows, groups, group)
    scale = blocks.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, groups * group)[:, :cols], scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """FP8 values [rows, cols] with scales [rows, ceil(cols / group)] -> fp32."""
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, group: int,
              bias: torch.Tensor | None = None, pow2_scales: bool = False) -> torch.Tensor:
    """x [tokens, in] quantized in groups of `group` inputs, times the FP8 weight [out, in] with its per-row
    group scales [out, ceil(in / group)]: dequantized, multiplied in fp32; returned in x's dtype."""
    x_q, x_scale = quantize(x, group, pow2_scales)
    y = dequantize(x_q, x_scale, group) @ dequantize(w_q, w_scale, group).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_supported(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """torch._scaled_mm takes FP8 operands whose inner and outer sizes are multiples of 16; on CUDA it needs
    FP8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    if w_q.shape[0] % 16 or w_q.shape[1] % 16 or not hasattr(torch, "_scaled_mm"):
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 9)


def _quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Triton launch on CUDA (plain torch took 80-150 us a call on the H200: five kernels and a copy)."""
    if x.is_cuda:
        from pressroom.kernels.triton.quant_gemv import quantize_per_token_fp8
        return quantize_per_token_fp8(x)
    return quantize(x, x.shape[1])


def scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [tokens, in] quantized per token, times the FP8 weight [out, in] with per-channel scales [out, 1],
    through torch._scaled_mm (the weight's row-major [out, in] is the column-major [in, out] it wants)."""
    x_q, x_scale = _quantize_per_token(x)
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                         out_dtype=out_dtype or x.dtype)
    return y if bias is None else y + bias.to(y.dtype)
