"""Mixture-of-experts with FP8 experts in DeepSeek's block form: the stacked form a `FusedMoE` would hold, its
quantization, and the torch reference (dequantize the chosen experts, then their SwiGLU MLPs) that the Triton kernel
(kernels/triton/fused_moe_fp8.py) is tested against; it is also the CPU path.

Each stacked matrix is float8_e4m3fn [experts, rows, cols] with one fp32 multiplier per 128 x 128 block
(DeepSeek's `weight_scale_inv`, a multiplier despite its name): scale [experts, ceil(rows / 128), ceil(cols / 128)].
w13 stacks gate's rows over up's ([experts, 2 * inter, hidden]) and keeps each half on its own grid of blocks, as a
checkpoint's separate gate and up tensors come: its scale is [experts, 2 * ceil(inter / 128), ceil(hidden / 128)],
gate's block rows then up's (the same as one grid over 2 * inter rows where inter is a multiple of 128). w2 is
[experts, hidden, inter] on one grid.

Activations follow DeepSeek's recipe where `quantize_activations` (the default): quantized to FP8 per token and
128-input group at run time (kernels/fp8.py's `quantize`), both the experts' input and the intermediate SiLU(gate) *
up, which is first rounded to the input's dtype as the kernel stores it; `pow2_scales` (checkpoints with scale_fmt
ue8m0) rounds each group's scale up to a power of two, as kernels/fp8.py's linear layers do. Without, the experts run
weight-only on the activations as they are (fp32 compute on the dequantized weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.kernels import fp8

BLOCK = 128  # a weight block's rows and columns, and an activation group's inputs


def blocks(n: int) -> int:
    return -(-n // BLOCK)


@dataclass(slots=True, frozen=True)
class Fp8Experts:
    """Stacked FP8 experts with block scales. `halves`: the rows split into that many equal parts, each on its own
    grid of blocks (w13: 2, gate and up; w2: 1)."""
    weight: torch.Tensor  # float8_e4m3fn [experts, rows, cols]
    scale: torch.Tensor  # float32 [experts, halves * ceil(rows / halves / 128), ceil(cols / 128)]
    halves: int = 1

    def __post_init__(self) -> None:
        experts, rows, cols = self.weight.shape
        if self.weight.dtype != fp8.FP8:
            raise ValueError(f"FP8 experts must be float8_e4m3fn, got {self.weight.dtype}.")
        if rows % self.halves:
            raise ValueError(f"{rows} rows do not split into {self.halves} halves.")
        want = (experts, self.halves * blocks(rows // self.halves), blocks(cols))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"FP8 experts of shape {tuple(self.weight.shape)} need block scales of shape {want} "
                             f"(128 x 128 blocks, {self.halves} grid(s) down the rows); got {tuple(self.scale.shape)}.")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert `expert`'s matrix [rows, cols] in `dtype` (exact in fp32)."""
        weight, scale = self.weight[expert].chunk(self.halves), self.scale[expert].chunk(self.halves)
        return torch.cat([dequantize_blocks(w, s) for w, s in zip(weight, scale)]).to(dtype)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 [rows, cols] with scales [ceil(rows / 128), ceil(cols / 128)] -> fp32."""
    rows, cols = q.shape
    full = scale.float().repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.float() * full[:rows, :cols]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (FP8 values, fp32 scales [..., ceil(rows / 128), ceil(cols / 128)]), each block scaled so
    its largest magnitude lands on FP8's largest value."""
    *lead, rows, cols = w.shape
    padded = F.pad(w.float(), (0, blocks(cols) * BLOCK - cols, 0, blocks(rows) * BLOCK - rows))
    tiles = padded.view(*lead, blocks(rows), BLOCK, blocks(cols), BLOCK)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / fp8.FP8_MAX
    q = (tiles / scale[..., :, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return q.view(padded.shape)[..., :rows, :cols].contiguous(), scale


def quantize(w: torch.Tensor, halves: int = 1) -> Fp8Experts:
    """Stacked experts [experts, rows, cols] -> Fp8Experts, each of the `halves` row parts quantized on its own grid."""
    parts = [quantize_blocks(part) for part in w.chunk(halves, dim=1)]
    return Fp8Experts(torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1), halves)


def as_fed(x: torch.Tensor, quantize_activations: bool, pow2_scales: bool = False) -> torch.Tensor:
    """The activations [rows, cols] the experts multiply, in fp32: quantized per 128-input group and dequantized
    (DeepSeek's recipe; `pow2_scales`: power-of-two scales), or x as it is."""
    if not quantize_activations:
        return x.float()
    return fp8.dequantize(*fp8.quantize(x, BLOCK, pow2_scales), BLOCK)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SiLU(gate) * up; DeepSeek-V4's clamped form where `limit` is given: gate clamped above at limit, up to
    [-limit, limit]."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def reference(x: torch.Tensor, w13: Fp8Experts, w2: Fp8Experts, weights: torch.Tensor, ids: torch.Tensor,
              quantize_activations: bool = True, swiglu_limit: float | None = None, pow2_scales: bool = False
              ) -> torch.Tensor:
    """x [tokens, hidden] through each token's chosen experts (ids [tokens, k] local to the experts, -1: another
    rank's), weighted by `weights` and summed; fp32 products on the dequantized experts. Each pair's output is
    rounded to x's dtype before the sum over k, as the kernel stores it. Returns [tokens, hidden] in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    fed = as_fed(x, quantize_activations, pow2_scales)
    for expert in ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = (fed[token] @ w13.dequantize(expert).t()).chunk(2, dim=-1)
        mid = swiglu(gate, up, swiglu_limit).to(x.dtype)
        y = as_fed(mid, quantize_activations, pow2_scales) @ w2.dequantize(expert).t()
        out.index_add_(0, token, (y * weights[token, slot].float().unsqueeze(1)).to(x.dtype).float())
    return out.to(x.dtype)
