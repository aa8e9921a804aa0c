"""A block-scaled FP8 GEMM for linear layers, DeepSeek's recipe: activations quantized to FP8 per token and
128-input group, weights FP8 with a scale per block of 128 inputs (model/quantization/fp8.py's per-row form: each
row holds its block's scales, [N, ceil(K / 128)]), each tile an FP8 x FP8 tl.dot (FP8 tensor cores: compute
capability 8.9 and later) whose fp32 product takes one activation scale per row and one weight scale per output
column; BLOCK_K divides 128, so a tile lies in one group.

For steps past the weight-only GEMV's (kernels/triton/quant_gemv.py: decode); kernels/fp8.py's `reference` is the
oracle (the same rounded operands, summed in another order). Not tuned: one launch shape, 64 x 64 x 128 tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels import fp8

GROUP = 128  # activation groups' inputs, the weight blocks' width
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 128, 4, 3


@triton.jit
def _block_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_a, stride_as, stride_w,
                       stride_ws, stride_y, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_scale = tl.load(as_ptr + rm * stride_as + k0 // GROUP, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_ptr + rn * stride_ws + k0 // GROUP, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def supported(w_scale: torch.Tensor, group: int) -> bool:
    """Weights in 128-input blocks (block scales, more than one group a row); other layouts take other paths."""
    return group == GROUP and w_scale.shape[1] > 1


def block_fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                     pow2_scales: bool = False) -> torch.Tensor:
    """x [M, K] quantized per token and 128 inputs (`pow2_scales`: power-of-two scales, ue8m0) times the FP8
    weight [N, K] with per-row block scales [N, ceil(K / 128)]; returned in x's dtype."""
    (m, k), n = x.shape, w_q.shape[0]
    if pow2_scales:  # the group-quantization launch rounds scales to amax / 448 exactly; this one is torch's
        x_q, x_scale = fp8.quantize(x, GROUP, pow2_scales=True)
    else:
        from pressroom.kernels.triton.fused_moe_fp8 import quantize_groups
        x_q, x_scale = quantize_groups(x.contiguous())
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # a grid of no programs is an error
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _block_gemm_kernel[grid](x_q, x_scale, w_q, w_scale, bias if bias is not None else y, y, m, n, k, x_q.stride(0),
                             x_scale.stride(0), w_q.stride(0), w_scale.stride(0), y.stride(0),
                             HAS_BIAS=bias is not None, GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
