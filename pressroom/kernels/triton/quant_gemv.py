"""Weight-only GEMV/GEMM for quantized weights, dequantized in registers, fp32 accumulation; and FP8 per-token
activation quantization for torch._scaled_mm.

Decode reads every weight once per step and does two flops per weight byte pair: it is bound by memory, so
reading FP8 (1 byte per weight) or MXFP4 (0.53 bytes) instead of bf16 (2 bytes) is the speed-up. Activations stay
in their dtype (bf16 on CUDA): nothing is lost to rounding them.

One kernel shape for both formats: a program owns BLOCK_N output channels of BLOCK_M tokens and walks the inputs
BLOCK_K at a time. BLOCK_M == 1 (one token) multiplies and sums on the CUDA cores: a [BLOCK_N, BLOCK_K] tile times
a broadcast row; BLOCK_M >= 16 goes through tl.dot (tensor cores) on the dequantized tile.

- FP8 e4m3 `w` [N, K] with fp32 scales [N, groups] per `group` inputs (model/quantization/fp8.py's form). One
  group per row: the scale multiplies the finished sum. Else BLOCK_K divides the group, so each tile's partial sum
  takes one scale per row.
- MXFP4 `w` packed [N, K / 2] (even input in the low nibble) with E8M0 scales [N, K / 32] (kernels/mxfp4.py).
  The two nibbles of a byte meet the even and the odd inputs of x: two half-width products, no interleaving.
  An E2M1 value times its block's power of two is built as fp32 bits directly (sign, exponent + scale, mantissa).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.fp8 import FP8, FP8_MAX

SMALL_M = 16  # up to this many tokens the weight-only GEMV path beats _scaled_mm (decode; small verify steps)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int  # inputs per tile (MXFP4: twice the bytes read per row)
    num_warps: int
    num_stages: int = 2


# picked on the H200 (benchmarks/gpu/quant_gemv.py sweeps these and prints the best per shape)
FP8_DECODE = GemvConfig(1, 8, 512, 4)
MXFP4_DECODE = GemvConfig(1, 8, 1024, 4)
SKINNY = GemvConfig(16, 32, 256, 4, 3)
LARGE = GemvConfig(64, 64, 64, 4, 3)


def default_config(tokens: int, mxfp4: bool) -> GemvConfig:
    if tokens == 1:
        return MXFP4_DECODE if mxfp4 else FP8_DECODE
    return SKINNY if tokens <= SMALL_M else LARGE


@triton.jit
def _tile_product(x, w, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """x [BLOCK_M, BK] (activation dtype) times w [BN, BK] (fp32) transposed -> fp32 [BLOCK_M, BN]."""
    if BLOCK_M == 1:
        return tl.sum(x.to(tl.float32) * w, axis=1)[None, :]
    return tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)


@triton.jit
def _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, GROUP,
                PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        part = _tile_product(x, w, BLOCK_M, PRECISION)
        if PER_ROW:
            acc += part
        else:  # BLOCK_K divides GROUP: one scale per row for this tile
            scale = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
            acc += part * scale[None, :]
    if PER_ROW:
        acc *= tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0)[None, :]
    _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _e2m1_times_scale(nibble, exponent):
    """E2M1 codes (int32, 0..15) times 2^exponent (int32: E8M0 - 127) as fp32, built from its bits: a normal
    code (e > 0) is 2^(e - 1) * (1 + m / 2), the subnormal one 0.5; zero stays (signed) zero."""
    sign = (nibble & 8).to(tl.uint32) << 28
    e = (nibble >> 1) & 3
    biased = tl.where(e > 0, e + 126, 126) + exponent
    mantissa = tl.where(e > 0, (nibble & 1) << 22, 0)
    keep = ((nibble & 7) != 0) & (biased > 0)  # zero codes; a product below fp32's normals flushes to zero
    bits = tl.where(keep, sign | (biased.to(tl.uint32) << 23) | mantissa.to(tl.uint32), sign)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rb = tl.arange(0, HALF)  # byte j of a tile holds inputs 2j (low nibble) and 2j + 1
    n_ok, m_ok = rn < N, rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + rn.to(tl.int64)[:, None] * stride_sn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        byte = k0 // 2 + rb
        w_mask = n_ok[:, None] & (byte < K // 2)[None, :]
        packed = tl.load(w_rows + byte[None, :], mask=w_mask, other=0).to(tl.int32)
        exponent = tl.load(s_rows + (byte // 16)[None, :], mask=w_mask, other=127).to(tl.int32) - 127
        x_mask = m_ok[:, None] & (2 * byte < K)[None, :]
        x_even = tl.load(x_rows + 2 * byte[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + 2 * byte[None, :] + 1, mask=x_mask, other=0.0)
        acc += _tile_product(x_even, _e2m1_times_scale(packed & 15, exponent), BLOCK_M, PRECISION)
        acc += _tile_product(x_odd, _e2m1_times_scale(packed >> 4, exponent), BLOCK_M, PRECISION)
    _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 activations: no TF32 rounding (tests)


def _grid(m: int, n: int, config: GemvConfig) -> tuple[int, int]:
    return triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m)


def fp8_block_k(group: int, groups: int, block_k: int) -> int | None:
    """The tile width for FP8 scales in groups of `group` inputs: any, for one group per row; else the largest
    power of two up to block_k that divides the group (None under 16: a tile that narrow is not worth it)."""
    if groups == 1:
        return block_k
    width = min(block_k, group & -group)
    return width if width >= 16 else None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None = None,
               config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] times the FP8 weight w [N, K] with fp32 scales [N, ceil(K / group)], in x's dtype."""
    (m, k), n = x.shape, w.shape[0]
    config = config or default_config(m, mxfp4=False)
    block_k = fp8_block_k(group, scale.shape[1], config.block_k)
    if block_k is None:
        raise ValueError(f"FP8 scales in groups of {group} inputs have no tile width of 16 or more that divides them.")
    x, y = x.contiguous(), torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fp8_kernel[_grid(m, n, config)](
        x, w, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0),
        y.stride(0), group, PER_ROW=scale.shape[1] == 1, HAS_BIAS=bias is not None, PRECISION=_precision(x),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] times the MXFP4 weight (packed [N, K / 2], E8M0 scales [N, K / 32]), in x's dtype."""
    (m, k), n = x.shape, packed.shape[0]
    if k % 32 or packed.shape[1] * 2 != k:
        raise ValueError(f"an MXFP4 weight packed as {tuple(packed.shape)} cannot multiply {k} inputs.")
    config = config or default_config(m, mxfp4=True)
    x, y = x.contiguous(), torch.empty(m, n, dtype=x.dtype, device=x.device)
    _mxfp4_kernel[_grid(m, n, config)](
        x, packed, scales, bias if bias is not None else y, y, m, n, k, x.stride(0), packed.stride(0),
        scales.stride(0), y.stride(0), HAS_BIAS=bias is not None, PRECISION=_precision(x),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=max(32, config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, MIN_AMAX: tl.constexpr,
                          FP8_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_LIMIT
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_LIMIT, FP8_LIMIT)  # rounded division, as torch's
        tl.store(q_ptr + row * stride_qm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, 1]): kernels/fp8.py's `quantize(x, K)` in one launch."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _per_token_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), MIN_AMAX=1e-12, FP8_LIMIT=FP8_MAX,
                                    BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, scale
