"""Dense GEMVs for decode steps of one to eight tokens, with the op before each projection in their prologue:
RMSNorm (and the residual add) before qkv and gate_up, SwiGLU's silu(gate) * up before down.

A decode step of a dense model reads every weight once and does two flops per weight: it is bound by memory, and at
batch 1 of an 8B model the separate norm and activation kernels between cuBLAS's GEMMs cost launches and gaps
(docs/BENCHMARKS.md's profile). Here one launch does each projection with what comes before it:

- A program owns block_n weight rows (bf16/fp16 [N, K] row-major) and walks K in block_k tiles, multiplying and
  adding on the CUDA cores into an fp32 [block_n, block_k] accumulator summed across K once at the end.
- `norm_gemv`: each program first recomputes each token's mean square (x is 8 KB a token at 4,096 inputs, read from
  L2) and program 0 writes the new residual stream (x + residual) to a fresh tensor; other programs must still read the
  old one, so it is never updated in place. The normalised activation is rounded to the activation dtype before
  the product, exactly where kernels/triton/norm.py's RMSNorm rounds it, so the result equals RMSNorm then F.linear
  up to the GEMM's summation order.
- `silu_mul_gemv`: silu(gate) * up in fp32 rounded once (kernels/triton/activation.py's), gate_up [tokens, 2 I] as
  LlamaMLP's fused projection lays it out (gate first).

Measured (benchmarks/gpu/norm_gemv.py, H100, 2026-12-07; docs/BENCHMARKS.md): at one token and Llama-3.1-8B's
shapes these run 2-14% faster than the norm/activation kernel + cuBLAS they replace (qkv 20.4 against 22.1 us, o
13.2 against 15.1, gate_up 78.7 against 80.2, down 40.0 against 43.3); splitting K over several programs never
helped at one token, so there is no split-K. A 2-8 token variant through tl.dot (tokens padded to 16 rows)
ran at 0.52-0.72x the unfused kernels on qkv, gate_up and down (o even) and was removed.

Steps of 2 to MAX_ROWS tokens (a decode step of a few sequences; speculative verification's 1 + K rows) take
`_gemv_rows_kernel`: the same CUDA-core loop, each [block_n, block_k] weight tile loaded once and multiplied into
every token row's fp32 accumulator ([rows, block_n, block_k], summed across K after the loop), the prologue exact
per row (each row its own mean square, the new residual stream written for every row; SwiGLU a row at a time).
More rows multiply the accumulator, so the default launches' block_k is cut to keep it within ACC_PER_THREAD
registers (`rows_launch`); an explicit launch runs as given (the sweep also tries twice the registers).
Compiled for sm_90 on the CPU (ptxas): no spills at the default launches; the K loop issues about 3.5-4
instructions a weight element a thread at one token, 6-10 at two rows, 9-17 at four, 17-33 at eight (8 FMAs a
weight, plus each row's prologue spread over only 8 weight rows a thread). An H100 streaming weights at its copy
rate leaves about 20 a weight, so eight rows, SwiGLU's most, may be bound by issue rather than memory.

Not yet measured on a GPU: GEMV_MAX_TOKENS stays 1 (the model's steps of 2-8 tokens take the norm kernel +
cuBLAS) until benchmarks/gpu/norm_gemv.py --tokens 2,4,8 shows the rows kernel beating them, and
MULTI_ROW_LAUNCHES is the one-token table until that sweep's best launches replace it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.fp8 import FP8
from pressroom.kernels.triton.quant_gemv import FP8_DECODE, FP8_DECODE_LONG_ROWS

GEMV_MAX_TOKENS = 1  # the one home of the rule: steps of at most this many tokens take these kernels
MAX_ROWS = 8  # the most token rows the kernels take (any step up to it runs; GEMV_MAX_TOKENS says which do)
_NONE, _NORM, _SILU = 0, 1, 2  # the prologue
_ONE_ROW = tl.constexpr(1)  # the one-token kernel's rows (a constexpr, as the helpers' ROWS must be)
_STATS_ELEMENTS = 8192  # the norm's statistics pass reads tiles of this many activations (one pass at 4,096 inputs)
# fp32 accumulators a thread of the rows kernel holds: the one-token launches' (16 x 512 over 4 warps, 8 x 2048 over
# 8); rows multiply the accumulator, so rows_launch cuts block_k to stay within it rather than spill registers.
ACC_PER_THREAD = 64
assert 1 <= GEMV_MAX_TOKENS <= MAX_ROWS


@dataclass(frozen=True, slots=True)
class GemvLaunch:
    """One launch's tiling: block_n weight rows a program, block_k inputs a tile."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of two, got {value}")


# shape class -> launch: the best of benchmarks/gpu/norm_gemv.py's sweep on the H100 (2026-12-07) at Llama-3.1-8B's
# shapes, one token: qkv 20.4 us, o 13.2 us (tied with 8 x 1024), gate_up 78.7 us, down 40.0 us.
DEFAULT_LAUNCHES: dict[str, GemvLaunch] = {
    "wide": GemvLaunch(16, 512),  # qkv
    "square": GemvLaunch(4, 2048),  # o
    "tall": GemvLaunch(8, 1024),  # gate_up
    "long": GemvLaunch(8, 1024),  # down
}
# shape class -> launch for FP8 weights (one scale a row), one token: quant_gemv's swept FP8 tiles (the same
# elementwise loop without the prologues), the long rows' for down.
_FP8_TILE = GemvLaunch(FP8_DECODE.block_n, FP8_DECODE.block_k, FP8_DECODE.num_warps)
FP8_LAUNCHES: dict[str, GemvLaunch] = {
    "wide": _FP8_TILE, "square": _FP8_TILE, "tall": _FP8_TILE,
    "long": GemvLaunch(FP8_DECODE_LONG_ROWS.block_n, FP8_DECODE_LONG_ROWS.block_k, FP8_DECODE_LONG_ROWS.num_warps),
}
# shape class -> launch for 2 to MAX_ROWS tokens, before rows_launch's cut: not yet swept, so the one-token table;
# benchmarks/gpu/norm_gemv.py --tokens 2,4,8 prints the best launch per shape to put here.
MULTI_ROW_LAUNCHES: dict[str, GemvLaunch] = dict(DEFAULT_LAUNCHES)


def rows_launch(launch: GemvLaunch, tokens: int, acc_cap: int = ACC_PER_THREAD) -> GemvLaunch:
    """The launch the rows kernel runs for `tokens` rows: block_k cut (to a power of two) so the accumulator of every
    row, rows x block_n x block_k, fits `acc_cap` registers a thread. One token: the launch as it is."""
    if tokens <= 1:
        return launch
    rows = triton.next_power_of_2(tokens)
    fits = max(1, acc_cap * 32 * launch.num_warps // (rows * launch.block_n))
    block_k = min(launch.block_k, 1 << (fits.bit_length() - 1))
    return GemvLaunch(launch.block_n, block_k, launch.num_warps, launch.num_stages)


def sweep_launches(tokens: int = 1) -> list[GemvLaunch]:
    """The launches benchmarks/gpu/norm_gemv.py times for each shape at `tokens` rows (DEFAULT_LAUNCHES' and
    MULTI_ROW_LAUNCHES' candidates), without repeats. One token: tiles of 4K to 16K weights over 4 to 32 rows (more
    rows a program: fewer re-reads of the activations from L2). More tokens, first: 64 or 128 rows a program (every
    row's activations re-read by fewer programs, and the fewest instructions a weight in ptxas's sm_90 output at 4
    and 8 rows, though the N = 4,096 shapes then fill only half the SMs) and twice ACC_PER_THREAD (fewer
    instructions again, 170-250 registers), then the one-token tiles and a deeper pipeline; each cut by
    rows_launch."""
    tiles = [(4, 2048, 4, 2), (8, 512, 4, 2), (8, 1024, 4, 2), (8, 2048, 8, 2), (16, 512, 4, 2), (16, 1024, 8, 2),
             (32, 512, 8, 2)]
    if tokens <= 1:
        return [GemvLaunch(*tile) for tile in tiles]
    first = [(64, 256, 8, 2, 1), (16, 512, 4, 2, 2), (32, 512, 8, 2, 1), (128, 256, 8, 2, 2), (64, 512, 16, 2, 1)]
    then = [(*tile, 1) for tile in tiles] + [(16, 512, 4, 3, 1), (32, 512, 8, 3, 1)]
    launches = [rows_launch(GemvLaunch(*tile[:4]), tokens, tile[4] * ACC_PER_THREAD) for tile in first + then]
    return list(dict.fromkeys(launches))


def acc_per_thread(launch: GemvLaunch, tokens: int) -> int:
    """The fp32 accumulators a thread holds at this launch and token count."""
    return triton.next_power_of_2(tokens) * launch.block_n * launch.block_k // (32 * launch.num_warps)


def shape_class(n: int, k: int) -> str:
    """'tall' for many short rows (gate_up), 'long' for few long rows (down), 'wide' for more rows than inputs
    (qkv), else 'square' (o)."""
    if n >= 4 * k:
        return "tall"
    if k >= 2 * n:
        return "long"
    return "wide" if n > k else "square"


def default_launch(n: int, k: int, tokens: int = 1, fp8: bool = False) -> GemvLaunch:
    """The table's launch for an [n, k] weight (FP8_LAUNCHES' for FP8 weights), cut by rows_launch past a token."""
    one_token = (FP8_LAUNCHES if fp8 else DEFAULT_LAUNCHES)[shape_class(n, k)]
    if tokens <= 1:
        return one_token
    return rows_launch(one_token if fp8 else MULTI_ROW_LAUNCHES[shape_class(n, k)], tokens)


@triton.jit
def _stream(x_ptr, res_ptr, x_row, res_row, k, mask, ADD_RESIDUAL: tl.constexpr):
    """The residual stream's tile [rows, BLOCK]: x + residual rounded to the residual's dtype (as torch's
    `x + residual`), or x. x_row, res_row [rows, 1]: each row's offset."""
    x = tl.load(x_ptr + x_row + k[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + res_row + k[None, :], mask=mask, other=0.0).to(tl.float32)
             ).to(res_ptr.dtype.element_ty)
    return x


@triton.jit
def _inv_rms(x_ptr, res_ptr, new_res_ptr, x_row, res_row, new_row, row_ok, K, eps, writer,
             ADD_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """1 / rms of each token's residual stream [ROWS]; the `writer` program also stores the streams. Wide tiles and a
    pipelined loop: every program waits for this before its first weight load."""
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok & (k < K)[None, :]
        h = _stream(x_ptr, res_ptr, x_row, res_row, k, mask, ADD_RESIDUAL)
        if ADD_RESIDUAL:
            tl.store(new_res_ptr + new_row + k[None, :], h, mask=mask & writer)
        h = h.to(tl.float32)
        total += tl.sum(h * h, 1)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _activation(x_ptr, res_ptr, nw_ptr, x_row, res_row, k, mask, K, inv_rms, PROLOGUE: tl.constexpr,
                ADD_RESIDUAL: tl.constexpr):
    """The product's left operand [rows, BLOCK_K] in the activation dtype, rounded where the unfused kernels round
    it."""
    if PROLOGUE == 2:  # silu(gate) * up: gate at [0, K), up at [K, 2K) of each row
        gate = tl.load(x_ptr + x_row + k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + x_row + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    if PROLOGUE == 1:
        h = _stream(x_ptr, res_ptr, x_row, res_row, k, mask, ADD_RESIDUAL).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return (h * inv_rms[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptr + x_row + k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_wn, eps,
                 PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr, STAGES: tl.constexpr):
    """One token: a [BLOCK_N, BLOCK_K] accumulator (the launches measured at one token)."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    row = tl.zeros((1, 1), dtype=tl.int32)  # the one row's offset: folds away
    inv_rms = tl.zeros((1,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, res_ptr, new_res_ptr, row, row, row, row == 0, K, eps, pid_n == 0, ADD_RESIDUAL,
                           _ONE_ROW, STATS_K, STAGES)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # elementwise products, summed across K after the loop
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = _activation(x_ptr, res_ptr, nw_ptr, row, row, k, k_ok[None, :], K, inv_rms, PROLOGUE, ADD_RESIDUAL)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
    out = tl.sum(acc, 1)
    if HAS_SCALE:  # FP8 weights: each row's scale
        out *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_rows_kernel(x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                      stride_rm, stride_wn, eps, PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr,
                      STAGES: tl.constexpr):
    """M tokens (ROWS: M's power of two, rows past M masked): each weight tile loaded once and multiplied into every
    row's [BLOCK_N, BLOCK_K] accumulator. x, residual: rows at their strides; new residual and out: contiguous."""
    pid_n = tl.program_id(0)
    rm = tl.arange(0, ROWS)
    row_ok = (rm < M)[:, None]
    x_row, res_row = (rm * stride_xm)[:, None], (rm * stride_rm)[:, None]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    inv_rms = tl.zeros((ROWS,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, res_ptr, new_res_ptr, x_row, res_row, (rm * K)[:, None], row_ok, K, eps,
                           pid_n == 0, ADD_RESIDUAL, ROWS, STATS_K, STAGES)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across K after the loop, as one token's
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = _activation(x_ptr, res_ptr, nw_ptr, x_row, res_row, k, row_ok & k_ok[None, :], K, inv_rms, PROLOGUE,
                        ADD_RESIDUAL)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * a.to(tl.float32)[:, None, :]
    out = tl.sum(acc, 2)
    if HAS_SCALE:
        out *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (rm * N)[:, None] + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok & n_ok[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, k: int, bias: torch.Tensor | None,
           scale: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or not 0 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"the fused GEMVs take x [tokens <= {MAX_ROWS}, features] with unit column stride "
                         f"(larger steps: the modules' forwards), got {tuple(x.shape)} with strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != (FP8 if scale is not None else x.dtype):
        raise ValueError(f"the fused GEMVs take bf16 or fp16 activations and weights of the same dtype (or FP8 e4m3 "
                         f"weights with their scales), got {x.dtype} and {w.dtype}")
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != w.shape[0] or not scale.is_contiguous()):
        raise ValueError(f"an FP8 weight's scales must be fp32, one a row ({w.shape[0]}), contiguous; got "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"the weight must be [out, {k}] with unit column stride, got {tuple(w.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")


def _launch(prologue: int, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, launch: GemvLaunch | None,
            residual: torch.Tensor | None = None, new_residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0, scale: torch.Tensor | None = None
            ) -> torch.Tensor:
    """y [m, n] = the prologue's activation of x times w^T (times each row's scale, + bias): one token through
    _gemv_kernel, 2 to MAX_ROWS through _gemv_rows_kernel; `launch` None: the table's, cut by rows_launch past one
    token."""
    (m, n), k = (x.shape[0], w.shape[0]), w.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    launch = launch or default_launch(n, k, m, fp8=scale is not None)  # an explicit launch runs as given
    res = residual if residual is not None else x  # placeholder pointers where a prologue reads none
    pointers = (x, res, new_residual if new_residual is not None else x,
                norm_weight if norm_weight is not None else x, w, scale if scale is not None else x,
                bias if bias is not None else x, y)
    flags = dict(PROLOGUE=prologue, ADD_RESIDUAL=residual is not None, HAS_SCALE=scale is not None,
                 HAS_BIAS=bias is not None,
                 BLOCK_N=launch.block_n, BLOCK_K=min(launch.block_k, triton.next_power_of_2(k)),
                 STAGES=launch.num_stages, num_warps=launch.num_warps)
    grid = (triton.cdiv(n, launch.block_n),)
    if m == 1:
        _gemv_kernel[grid](*pointers, n, k, w.stride(0), eps, STATS_K=min(triton.next_power_of_2(k), _STATS_ELEMENTS),
                           **flags)
        return y
    rows = triton.next_power_of_2(m)
    _gemv_rows_kernel[grid](*pointers, m, n, k, x.stride(0), res.stride(0), w.stride(0), eps, ROWS=rows,
                            STATS_K=min(triton.next_power_of_2(k), _STATS_ELEMENTS // rows), **flags)
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         launch: GemvLaunch | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens <= MAX_ROWS, K] -> F.linear(x, w, bias) [tokens, N]. `scale`: w is FP8 e4m3 with one fp32 scale a
    row (quant_gemv.fp8_linear's weight-only product, with these kernels' prologues)."""
    _check(x, w, x.shape[-1] if x.dim() else 0, bias, scale)
    return _launch(_NONE, x, w, bias, launch, scale=scale)


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
              residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              launch: GemvLaunch | None = None, scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(h), w, bias), h) where h = x + residual (rounded to the activation dtype), or x where
    residual is None: RMSNorm's forward (model/layers/norm.py) and the next projection in one launch. x and
    residual are left as they are; the new residual stream is a new tensor. `scale`: as gemv's."""
    _check(x, w, x.shape[-1] if x.dim() else 0, bias, scale)
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} ({x.dtype}) with unit column stride, got "
                         f"{tuple(residual.shape)} ({residual.dtype})")
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = _launch(_NORM, x, w, bias, launch, residual, new_residual, norm_weight, eps, scale)
    return y, new_residual


def silu_mul_gemv(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  launch: GemvLaunch | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [tokens <= MAX_ROWS, 2 I] (gate first, as LlamaMLP's gate_up_proj) -> F.linear(silu(gate) * up, w,
    bias) [tokens, N], the activation computed in fp32 and rounded once, as kernels/triton/activation.py's.
    `scale`: as gemv's."""
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * I], got {tuple(gate_up.shape)}")
    _check(gate_up, w, width // 2, bias, scale)
    return _launch(_SILU, gate_up, w, bias, launch, scale=scale)
