"""Mixture-of-experts with FP4 experts (MXFP4 or NVFP4, weight-only): the stacked form a `FusedMoE` holds, its
quantization and the torch reference (dequantize, then the per-expert SwiGLU MLPs) that the Triton kernel
(kernels/triton/fused_moe.py `fused_moe_fp4`) is tested against.

Each stacked matrix (w13: gate rows then up rows, [experts, 2 * inter, hidden]; w2: [experts, hidden, inter]) is
kept as kernels/mxfp4.py or kernels/nvfp4.py keeps a linear layer's weight, one more dimension in front: packed
E2M1 [experts, rows, cols / 2] (the even input in the low nibble), block scales [experts, rows, cols / block] and,
for NVFP4, an fp32 global scale per row [experts, rows] (a checkpoint's gate and up may carry different ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.kernels import mxfp4, nvfp4
from pressroom.kernels.moe_activation import ClampedSwiglu, gated

FORMATS = ("mxfp4", "nvfp4")


@dataclass(slots=True)
class Fp4Experts:
    packed: torch.Tensor  # uint8 [experts, rows, cols / 2]
    scales: torch.Tensor  # [experts, rows, cols / block]: E8M0 uint8 (MXFP4) or float8_e4m3fn (NVFP4)
    global_scale: torch.Tensor | None  # NVFP4: fp32 [experts, rows]; MXFP4: None

    @property
    def block(self) -> int:
        return mxfp4.BLOCK if self.global_scale is None else nvfp4.BLOCK

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, half = self.packed.shape
        return experts, rows, 2 * half

    def dequantize(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert `expert`'s matrix [rows, cols] in `dtype` (exact in fp32)."""
        if self.global_scale is None:
            return mxfp4.dequantize(self.packed[expert], self.scales[expert], dtype)
        return nvfp4.dequantize(self.packed[expert], self.scales[expert], self.global_scale[expert], dtype)


def quantize_rows(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One matrix [rows, cols] -> (packed, block scales, per-row global scales or None) in `fmt`; NVFP4's global
    scale is the matrix's (NVIDIA's recipe), repeated down its rows."""
    if fmt == "mxfp4":
        return (*mxfp4.quantize(w), None)
    packed, scales, global_scale = nvfp4.quantize(w)
    return packed, scales, global_scale.expand(w.shape[0]).contiguous()


def quantize(w: torch.Tensor, fmt: str) -> Fp4Experts:
    """Stacked experts [experts, rows, cols] -> Fp4Experts, one expert at a time (each expert's own global scale:
    gate and up share one, as ModelOpt exports them)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP4 format {fmt!r}; use one of {', '.join(FORMATS)}.")
    parts = [quantize_rows(w[e], fmt) for e in range(w.shape[0])]
    packed, scales, global_scale = (None if p[0] is None else torch.stack(p) for p in zip(*parts))
    return Fp4Experts(packed, scales, global_scale)


def reference(x: torch.Tensor, w13: Fp4Experts, w2: Fp4Experts, weights: torch.Tensor, ids: torch.Tensor,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: ClampedSwiglu | None = None) -> torch.Tensor:
    """x [tokens, hidden] through each token's chosen experts (ids [tokens, k] local to w13's experts, -1: another
    rank's), weighted by `weights` and summed: each expert's matrices dequantized to x's dtype, then the SwiGLU
    MLP in x's dtype (weight-only: activations are not quantized). gpt-oss: biases [experts, 2 * inter] and
    [experts, hidden] (dense), and the clamped SwiGLU as `activation`."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (ids == expert).nonzero(as_tuple=True)
        b13 = None if w13_bias is None else w13_bias[expert].to(x.dtype)
        b2 = None if w2_bias is None else w2_bias[expert].to(x.dtype)
        gate, up = F.linear(x[token], w13.dequantize(expert, x.dtype), b13).chunk(2, dim=-1)
        y = F.linear(gated(gate, up, activation), w2.dequantize(expert, x.dtype), b2)
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1).to(y.dtype))
    return out
