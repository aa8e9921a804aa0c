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
  The kernels read the bytes as 32-bit words (eight inputs): two shifts and a masked merge turn two codes into
  two fp16 bit patterns (value * 2^-14, exact; 0.5 a subnormal), and interleaving in registers puts the values in
  input order, so x is read contiguously. One token (_fp4_gemv_kernel) loads a scale block's words into one
  thread, sums its 32 products there and scales the sum; tl.dot tiles (2 to SMALL_M tokens, and the MoE kernel)
  scale the values first. Beyond SMALL_M tokens the weight is dequantized to bf16 by one launch for cuBLAS.
- NVFP4 (kernels/nvfp4.py): the same kernels with blocks of 16 inputs (8 bytes), each scaled by an FP8 e4m3 value
  times its row's fp32 global scale (read from memory: no host sync, CUDA graphs keep it; one value for every row
  reads with stride 0).

Measured on the H200 (docs/BENCHMARKS.md), one token at Llama-3.1-8B's shapes: the FP8 GEMV runs 1.46-1.80x bf16
F.linear, the MXFP4 GEMV 1.74x over a layer's four projections (a byte at a time and x read at a stride of two,
it ran 0.59x). The compiled loop spends about 5.5 instructions a value (unpacking 2.6, the fp16-to-fp32
conversion and the FMA one each): it is bound by instruction issue, not by HBM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn  # kernels/fp8.py's, restated: that module calls into this one
FP8_MAX = torch.finfo(FP8).max
SMALL_M = 16  # up to this many tokens the weight-only GEMV path beats _scaled_mm (decode; small verify steps)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int  # inputs per tile (MXFP4: twice the bytes read per row)
    num_warps: int
    num_stages: int = 2


# One token, FP8, the elementwise loop (a tile's products held in registers): the best of benchmarks/gpu/
# quant_gemv.py's sweep on an H100 (2026-12-07, docs/BENCHMARKS.md) took 4 rows at every 8B shape, 1,024 inputs
# (qkv's best, 512, within 2 us) and for the long rows of down 2,048 with 8 warps (24.0 us against 28.5).
FP8_DECODE = GemvConfig(1, 4, 1024, 4)
FP8_DECODE_LONG_ROWS = GemvConfig(1, 4, 2048, 8)
# FP4, one token (_fp4_gemv_kernel: two groups of block_n rows a program): the sweep's best on the H200 took 4 rows,
# 3 stages and 1,024 inputs a tile (2,048 for the longer rows of down).
FP4_DECODE = GemvConfig(1, 4, 1024, 4, 3)
FP4_DECODE_LONG_ROWS = GemvConfig(1, 4, 2048, 4, 3)
# int4 (GPTQ form), one token: one group of inputs per tile, 8 outputs, one warp: the best of a six-tile probe on the
# H200 (2026-12-03; 0.63x bf16 F.linear at qkv, 1.05x at gate_up, 0.37x at down: too few programs walk too long a
# K; a split-K is the next step). 64 outputs with 4 warps ran 0.12-0.37x.
INT4_DECODE = GemvConfig(1, 8, 128, 1)
SKINNY = GemvConfig(16, 32, 256, 4, 3)  # 2-16 tokens: within 1% of the sweep's best but at gate_up (11%)
LARGE = GemvConfig(64, 64, 64, 4, 3)  # beyond 16 tokens: only where asked for (tests); callers use cuBLAS there


def default_config(tokens: int, n: int, k: int, mxfp4: bool) -> GemvConfig:
    if tokens == 1:
        if mxfp4:
            config = FP4_DECODE_LONG_ROWS if k > 4096 else FP4_DECODE
        else:
            config = FP8_DECODE_LONG_ROWS if k > 4096 else FP8_DECODE
        return GemvConfig(1, config.block_n, min(config.block_k, max(32, triton.next_power_of_2(k))),
                          config.num_warps, config.num_stages)
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
def _fp8_tiles(w_rows, x_rows, k, K, n_ok, m_ok):
    """The FP8 weight rows' tile at inputs k, widened to fp32, and the activation rows' (their dtype)."""
    k_ok = k < K
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    return w, tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)


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
    if BLOCK_M == 1 and PER_ROW:  # one token: products add up elementwise, summed across K once (no per-tile
        prods = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # shuffles: ~0.9 of 4.4 instructions a value)
        for k0 in range(0, K, BLOCK_K):
            w, x = _fp8_tiles(w_rows, x_rows, k0 + rk, K, n_ok, m_ok)
            prods += w * x.to(tl.float32)
        acc = tl.sum(prods, axis=1)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w, x = _fp8_tiles(w_rows, x_rows, k0 + rk, K, n_ok, m_ok)
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
def _e8m0_scale(exponent):
    """E8M0 (uint8 loaded as int32) -> 2^(e - 127) * 2^14 (undoing the unpacking's 2^-14); e = 0 (2^-127) reads
    as 0."""
    return (exponent << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _block_scales(s_rows, g_rows, blocks, mask, BB: tl.constexpr):
    """The scales of `blocks` [BLOCK_N, B] times 2^14: MXFP4 (BB = 16 bytes a block) its E8M0 exponents, NVFP4
    (BB = 8) its FP8 e4m3 block scales times the row's global scale at g_rows."""
    if BB == 16:
        return _e8m0_scale(tl.load(s_rows + blocks, mask=mask, other=0).to(tl.int32))
    g = tl.load(g_rows, mask=mask, other=0.0)
    return tl.load(s_rows + blocks, mask=mask, other=0.0).to(tl.float32) * (g * 16384.0)


@triton.jit
def _fp16_pairs(words, J: tl.constexpr):
    """uint32 words of eight E2M1 codes (input i of the word in bits 4i..4i+3) -> uint32s holding two fp16 bit
    patterns, code J in the low half and code J + 4 in the high half, each worth value * 2^-14 exactly: a code's
    magnitude bits land in an fp16's exponent and mantissa (0.5 as a subnormal), its sign in the sign. One shift
    pair and one masked merge make two values (a byte at a time took five operations a value)."""
    MAG: tl.constexpr = 9 - 4 * J  # magnitude bits 0..2 of code J go to bits 9..11, its sign bit 3 to bit 15
    if MAG >= 0:
        magnitude = words << MAG
    else:
        magnitude = words >> -MAG
    return (magnitude & 0x0E000E00) | ((words << (12 - 4 * J)) & 0x80008000)


@triton.jit
def _halves(pairs):
    low = pairs.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _word_values(words):
    """uint32 words [..., W] -> their 8W values [..., 8W] in input order (times 2^-14): codes j and j + 4 come out
    together, and three rounds of interleaving put input 8w + i at column 8w + i (register moves, no memory)."""
    v0, v4 = _halves(_fp16_pairs(words, 0))
    v1, v5 = _halves(_fp16_pairs(words, 1))
    v2, v6 = _halves(_fp16_pairs(words, 2))
    v3, v7 = _halves(_fp16_pairs(words, 3))
    even = tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6))  # column 4w + q: input 8w + 2q
    odd = tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7))  # column 4w + q: input 8w + 2q + 1
    return tl.interleave(even, odd)


@triton.jit
def _fp4_scales(s_rows, g_rows, k0, n_ok, K, BLOCK_K: tl.constexpr, BB: tl.constexpr):
    blocks = k0 // (2 * BB) + tl.arange(0, BLOCK_K // (2 * BB))
    return _block_scales(s_rows, g_rows, blocks[None, :], n_ok[:, None] & (blocks < K // (2 * BB))[None, :], BB)


@triton.jit
def fp4_blocks(w_rows, s_rows, g_rows, k0, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BB: tl.constexpr):
    """The FP4 tile of inputs [k0, k0 + BLOCK_K) (k0 a multiple of BLOCK_K, itself a multiple of a scale block's
    2 * BB inputs) of the rows at w_rows (int32 words: the packed bytes seen four at a time; masked by n_ok), for
    sums on the CUDA cores: (values [BLOCK_N, blocks, 2 * BB] times 2^-14, the blocks' scales [BLOCK_N, blocks]
    times 2^14). The words are loaded a block to a thread, so a block's unpacking and sum stay in its registers
    (a flat tile spread a block's words over threads and summed them by warp shuffles)."""
    blocks = k0 // (2 * BB) + tl.arange(0, BLOCK_K // (2 * BB))
    word = blocks[:, None] * (BB // 4) + tl.arange(0, BB // 4)[None, :]
    mask = n_ok[:, None, None] & (blocks < K // (2 * BB))[None, :, None]
    words = tl.load(w_rows[:, :, None] + word[None, :, :], mask=mask, other=0)
    return _word_values(words.to(tl.uint32, bitcast=True)), _fp4_scales(s_rows, g_rows, k0, n_ok, K, BLOCK_K, BB)


@triton.jit
def fp4_weights(w_rows, s_rows, g_rows, k0, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BB: tl.constexpr):
    """The same tile as fp4_blocks, scaled: the weights [BLOCK_N, BLOCK_K] exactly, in fp32, for tl.dot and the
    dequantizer. The words load as a flat [BLOCK_N, words] tile: the layout tl.dot's operand wants (the
    per-block one measured 20% slower at 16 tokens on the H200)."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_rows + word[None, :], mask=n_ok[:, None] & (word < K // 8)[None, :], other=0)
    values = tl.reshape(_word_values(words.to(tl.uint32, bitcast=True)), (BLOCK_N, BLOCK_K // (2 * BB), 2 * BB))
    scale = _fp4_scales(s_rows, g_rows, k0, n_ok, K, BLOCK_K, BB)
    return tl.reshape(values * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _fp4_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_g,
                     HAS_BIAS: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token: a program owns two groups of BLOCK_N rows laid out alike, so each thread converts its slice of x
    to fp32 once for both. A block's products are summed in one thread, scaled, and kept apart until the loop
    ends (one cross-thread sum, after it)."""
    NB: tl.constexpr = BLOCK_K // (2 * BB)
    rn = tl.program_id(0) * (2 * BLOCK_N) + tl.arange(0, BLOCK_N)
    rn2 = rn + BLOCK_N
    n_ok, n2_ok = rn < N, rn2 < N
    row, row2 = rn.to(tl.int64)[:, None], rn2.to(tl.int64)[:, None]
    sums = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    sums2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, NB)[:, None] * (2 * BB) + tl.arange(0, 2 * BB)[None, :]
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :, :]
        values, scale = fp4_blocks(w_ptr + row * stride_wn, s_ptr + row * stride_sn, g_ptr + row * stride_g, k0,
                                   n_ok, K, BLOCK_N, BLOCK_K, BB)
        sums += tl.sum(values * x, axis=2) * scale
        values, scale = fp4_blocks(w_ptr + row2 * stride_wn, s_ptr + row2 * stride_sn, g_ptr + row2 * stride_g,
                                   k0, n2_ok, K, BLOCK_N, BLOCK_K, BB)
        sums2 += tl.sum(values * x, axis=2) * scale
    y, y2 = tl.sum(sums, axis=1), tl.sum(sums2, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y2 += tl.load(b_ptr + rn2, mask=n2_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    tl.store(y_ptr + rn2, y2.to(y_ptr.dtype.element_ty), mask=n2_ok)


@triton.jit
def _fp4_kernel(x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_g,
                stride_ym, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BB: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Several tokens: w_ptr the packed weight as int32 words (stride_wn in words); tl.dot on the scaled values."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    row = rn.to(tl.int64)[:, None]
    w_rows, s_rows, g_rows = w_ptr + row * stride_wn, s_ptr + row * stride_sn, g_ptr + row * stride_g
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        weights = fp4_weights(w_rows, s_rows, g_rows, k0, n_ok, K, BLOCK_N, BLOCK_K, BB)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        acc += _tile_product(x, weights, BLOCK_M, PRECISION)
    _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _fp4_dequantize_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_g, stride_on,
                           BB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    row = rn.to(tl.int64)[:, None]
    weights = fp4_weights(w_ptr + row * stride_wn, s_ptr + row * stride_sn, g_ptr + row * stride_g, k0, n_ok, K,
                          BLOCK_N, BLOCK_K, BB)
    tl.store(out_ptr + row * stride_on + k[None, :], weights.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (k < K)[None, :])


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
    config = config or default_config(m, n, k, mxfp4=False)
    block_k = fp8_block_k(group, scale.shape[1], config.block_k)
    if block_k is None:
        raise ValueError(f"FP8 scales in groups of {group} inputs have no tile width of 16 or more that divides them.")
    x, y = x.contiguous(), torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # a grid of no programs is an error
        return y
    _fp8_kernel[_grid(m, n, config)](
        x, w, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0),
        y.stride(0), group, PER_ROW=scale.shape[1] == 1, HAS_BIAS=bias is not None, PRECISION=_precision(x),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] times the MXFP4 weight (packed [N, K / 2], E8M0 scales [N, K / 32]), in x's dtype. Beyond
    SMALL_M tokens (prefill) the weight is dequantized to x's dtype for cuBLAS: compute-bound there, and the
    tiled Triton GEMM measured 40x slower than bf16 at 512 tokens on the H200 (its unpacking per tile)."""
    return _fp4_linear(x, packed, scales, scales, bias, config, block_bytes=16)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] times the NVFP4 weight (packed [N, K / 2], FP8 e4m3 block scales [N, K / 16], fp32 global scales
    [N] or [1], kernels/nvfp4.py), in x's dtype; as mxfp4_linear beyond SMALL_M tokens."""
    return _fp4_linear(x, packed, scales, global_scale, bias, config, block_bytes=8)


def _fp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                bias: torch.Tensor | None, config: GemvConfig | None, block_bytes: int) -> torch.Tensor:
    (m, k), n = x.shape, packed.shape[0]
    if k % (2 * block_bytes) or packed.shape[1] * 2 != k:
        raise ValueError(f"an FP4 weight packed as {tuple(packed.shape)} cannot multiply {k} inputs.")
    if config is None and m > SMALL_M:
        return torch.nn.functional.linear(x, _fp4_dequantize(packed, scales, global_scale, x.dtype, block_bytes),
                                          bias)
    config = config or default_config(m, n, k, mxfp4=True)
    x, y = x.contiguous(), torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    words = as_words(packed)
    if m == 1 and config.block_m == 1:
        _fp4_gemv_kernel[(triton.cdiv(n, 2 * config.block_n),)](
            x, words, scales, global_scale, bias if bias is not None else y, y, n, k, words.stride(0),
            scales.stride(0), _global_stride(global_scale, n), HAS_BIAS=bias is not None, BB=block_bytes,
            BLOCK_N=config.block_n, BLOCK_K=max(4 * block_bytes, config.block_k), num_warps=config.num_warps,
            num_stages=config.num_stages)
        return y
    _fp4_kernel[_grid(m, n, config)](
        x, words, scales, global_scale, bias if bias is not None else y, y, m, n, k, x.stride(0), words.stride(0),
        scales.stride(0), _global_stride(global_scale, n), y.stride(0), HAS_BIAS=bias is not None,
        PRECISION=_precision(x), BB=block_bytes, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=max(4 * block_bytes, config.block_k), num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def as_words(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes [..., K / 2] seen as int32 words [..., K / 8] (four bytes, eight inputs a word), which the
    kernels read: a view where every row starts on a whole word (as loaded and quantized weights do), else a copy."""
    aligned = (packed.stride(-1) == 1 and packed.shape[-1] % 4 == 0 and packed.storage_offset() % 4 == 0
               and all(stride % 4 == 0 for stride in packed.stride()[:-1]))
    return (packed if aligned else packed.contiguous()).view(torch.int32)


def _global_stride(global_scale: torch.Tensor, n: int) -> int:
    """NVFP4's global scales: one per row (stride 1) or one for all (stride 0). MXFP4 passes its scales here,
    unread: stride 0."""
    return 1 if global_scale.dtype == torch.float32 and global_scale.numel() == n > 1 else 0


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MXFP4 weight as [N, K] in `dtype`, in one launch (kernels/mxfp4.py's `dequantize`)."""
    return _fp4_dequantize(packed, scales, scales, dtype, block_bytes=16)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The NVFP4 weight as [N, K] in `dtype`, in one launch (kernels/nvfp4.py's `dequantize`)."""
    return _fp4_dequantize(packed, scales, global_scale, dtype, block_bytes=8)


def _fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
                    block_bytes: int) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    block_n, block_k = 16, min(256, max(4 * block_bytes, triton.next_power_of_2(k)))
    words = as_words(packed)
    _fp4_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        words, scales, global_scale, out, n, k, words.stride(0), scales.stride(0), _global_stride(global_scale, n),
        out.stride(0), BB=block_bytes, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


@triton.jit
def _int4_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qk, stride_sg,
                 stride_zg, stride_ym, GROUP, ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GPTQ-form int4 (kernels/int4.py): each tile reads BLOCK_K / 8 packed words per output channel, shifts the
    eight nibbles of a word out in registers and takes (q - zero) * scale in fp32: one scale and zero per channel
    for the tile (BLOCK_K divides the group), or, with act-order, each input's group from g_idx."""
    WORDS: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, WORDS)
    shifts = tl.arange(0, 8) * 4
    n_ok, m_ok = rn < N, rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        word = k0 // 8 + rw
        w_mask = (word < K // 8)[:, None] & n_ok[None, :]
        packed = tl.load(qw_ptr + word.to(tl.int64)[:, None] * stride_qk + rn[None, :], mask=w_mask, other=0)
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))  # input k0 + 8w + j
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if ACT_ORDER:  # a gather per input: [BLOCK_K, BLOCK_N] scales and zeros
            g = tl.load(g_ptr + k, mask=k_ok, other=0)
            mask = k_ok[:, None] & n_ok[None, :]
            scale = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g[:, None] * stride_zg + rn[None, :], mask=mask, other=0).to(tl.int32)
        else:  # the tile lies in one group
            g = k0 // GROUP
            scale = tl.load(s_ptr + g * stride_sg + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(z_ptr + g * stride_zg + rn, mask=n_ok, other=0).to(tl.int32)[None, :]
        w = (q - zero).to(tl.float32) * scale  # [BLOCK_K, BLOCK_N], exact in fp32
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(tl.reshape(x.to(tl.float32), (BLOCK_K, 1)) * w, axis=0)[None, :]
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


def int4_block_k(group: int, k: int, act_order: bool, block_k: int) -> int:
    """The tile width: a power of two of at least 16 (8 inputs a word; tl.dot's minimum) that, without act-order,
    divides the group, so each tile takes one scale per channel."""
    width = min(block_k, max(16, triton.next_power_of_2(k)))
    if not act_order:
        width = min(width, group & -group)
    if width < 16:
        raise ValueError(f"int4 groups of {group} inputs have no tile width of 16 or more that divides them.")
    return width


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] times the GPTQ-form int4 weight (qweight int32 [K / 8, N], scales fp16 [G, N], zeros uint8 [G, N],
    g_idx int32 [K] or None), in x's dtype. Beyond SMALL_M tokens the weight is dequantized to x's dtype for cuBLAS
    (compute-bound there)."""
    (m, k), n = x.shape, qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"an int4 weight packed as {tuple(qweight.shape)} cannot multiply {k} inputs.")
    if config is None and m > SMALL_M:
        from pressroom.kernels.int4 import dequantize
        return torch.nn.functional.linear(x, dequantize(qweight, scales, zeros, g_idx, group_size, x.dtype), bias)
    config = config or (INT4_DECODE if m == 1 else default_config(m, n, k, mxfp4=False))
    block_k = int4_block_k(group_size, k, g_idx is not None, config.block_k)
    x, y = x.contiguous(), torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _int4_kernel[_grid(m, n, config)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias if bias is not None else y, y, m, n,
        k, x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0), group_size,
        ACT_ORDER=g_idx is not None, HAS_BIAS=bias is not None, PRECISION=_precision(x), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages)
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
