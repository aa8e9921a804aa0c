"""Dense GEMVs for decode steps of at most GEMV_MAX_TOKENS tokens, with the op before each projection in their
prologue: RMSNorm (and the residual add) before qkv and gate_up, SwiGLU's silu(gate) * up before down.

A decode step of a dense model reads every weight once and does two flops per weight: it is bound by memory, and at
batch 1 of an 8B model the separate norm, activation and split-K reduce kernels between cuBLAS's GEMMs cost about a
tenth of the step in launches and gaps (docs/BENCHMARKS.md's profile). Here one launch does each projection with
what comes before it:

- A program owns block_n weight rows (bf16/fp16 [N, K] row-major) for every token (M <= GEMV_MAX_TOKENS, padded
  to one tile of rows) and walks K in block_k tiles. One token multiplies and adds on the CUDA cores (an fp32
  [block_n, block_k] accumulator, summed across K once at the end); 2 to 8 tokens go through tl.dot (tensor cores,
  the tokens padded to 16 rows). Sums are fp32.
- `norm_gemv`: each program first recomputes its rows' mean square (x is 8 KB a token at 4,096 inputs, read from
  L2) and program 0 writes the new residual stream (x + residual) to a fresh tensor; other programs must still
  read the old one, so it is never updated in place. The normalised activation is rounded to the activation dtype
  before the product, exactly where kernels/triton/norm.py's RMSNorm rounds it, so the result equals RMSNorm then
  F.linear up to the GEMM's summation order.
- `silu_mul_gemv`: silu(gate) * up in fp32 rounded once (kernels/triton/activation.py's), gate_up [M, 2 I] as
  LlamaMLP's fused projection lays it out (gate first).
- Split-K: where N / block_n leaves too few programs to keep the SMs streaming (o_proj, down: 4,096 rows),
  split_k programs share a row block's inputs and write fp32 partial sums; a second, tiny pass adds them in a
  fixed order (no atomics: the same bits every run).

Launch configurations: `GemvLaunch`, one per (token bucket, shape class) in `DEFAULT_LAUNCHES`;
benchmarks/gpu/norm_gemv.py sweeps them against the unfused kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting

GEMV_MAX_TOKENS = 8  # the one home of the rule: steps of at most this many tokens take these kernels
_INTERPRETED = interpreting()
_DOT_ROWS = 16  # tl.dot's smallest tile: 2 to GEMV_MAX_TOKENS tokens are padded to it
_NONE, _NORM, _SILU = 0, 1, 2  # the prologue
_SUM_BLOCK = 1024  # outputs a program of the split-K pass adds
_STATS_ELEMENTS = 8192  # the norm's statistics pass reads tiles of this many activations (one pass at 4,096 inputs)


@dataclass(frozen=True, slots=True)
class GemvLaunch:
    """One launch's tiling: block_n weight rows a program, block_k inputs a tile, K split over split_k programs."""
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of two, got {value}")
        if self.split_k < 1:
            raise ValueError(f"GemvLaunch.split_k must be at least 1, got {self.split_k}")


# (tokens bucket, shape class) -> launch. Guesses until benchmarks/gpu/norm_gemv.py's sweep on the H100/H200 picks:
# one token: long tiles over few rows (more programs, each with several 16-byte loads a thread in flight); two to
# eight: tl.dot over 32 rows, 256 inputs a tile, 3 stages; split-K where the rows are few and long.
DEFAULT_LAUNCHES: dict[tuple[int, str], GemvLaunch] = {
    (1, "square"): GemvLaunch(8, 1024),
    (1, "tall"): GemvLaunch(8, 1024),
    (1, "long"): GemvLaunch(8, 1024, split_k=2),
    (GEMV_MAX_TOKENS, "square"): GemvLaunch(32, 256, num_stages=3),
    (GEMV_MAX_TOKENS, "tall"): GemvLaunch(32, 256, num_stages=3),
    (GEMV_MAX_TOKENS, "long"): GemvLaunch(32, 256, split_k=2, num_stages=3),
}


def sweep_launches(tokens: int, n: int, k: int) -> list[GemvLaunch]:
    """The launches benchmarks/gpu/norm_gemv.py times for a shape (DEFAULT_LAUNCHES' candidates): one token, tiles
    of 4K to 16K weights over 4 to 32 rows (more rows a program: fewer re-reads of the activations from L2);
    more tokens, tl.dot tiles of 16 to 64 rows; split-K only where the rows are few (N <= 4,096)."""
    if tokens == 1:
        tiles = [(4, 2048, 4), (8, 512, 4), (8, 1024, 4), (8, 2048, 8), (16, 512, 4), (16, 1024, 8), (32, 512, 8)]
    else:
        tiles = [(16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 128, 4), (64, 256, 8)]
    splits = (1, 2, 4) if n <= 4096 else (1,)
    stages = 2 if tokens == 1 else 3
    return [GemvLaunch(block_n, block_k, split, warps, stages) for block_n, block_k, warps in tiles for split in splits
            if split == 1 or triton.cdiv(k, split) >= block_k]


def shape_class(n: int, k: int) -> str:
    """'tall' for many short rows (gate_up), 'long' for few long rows (down), else 'square' (qkv, o)."""
    if n >= 4 * k:
        return "tall"
    return "long" if k >= 2 * n else "square"


def default_launch(tokens: int, n: int, k: int) -> GemvLaunch:
    return DEFAULT_LAUNCHES[(1 if tokens == 1 else GEMV_MAX_TOKENS, shape_class(n, k))]


@triton.jit
def _rows(ptr, rm, k, mask, stride):
    return tl.load(ptr + rm.to(tl.int64)[:, None] * stride + k[None, :], mask=mask, other=0.0)


@triton.jit
def _stream(x_ptr, res_ptr, rm, k, mask, stride_xm, stride_rm, ADD_RESIDUAL: tl.constexpr):
    """The residual stream's tile: x + residual rounded to the residual's dtype (as torch's `x + residual`), or x."""
    x = _rows(x_ptr, rm, k, mask, stride_xm)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + _rows(res_ptr, rm, k, mask, stride_rm).to(tl.float32)).to(res_ptr.dtype.element_ty)
    return x


@triton.jit
def _inv_rms(x_ptr, res_ptr, new_res_ptr, rm, m_ok, K, stride_xm, stride_rm, eps, writer,
             ADD_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """1 / rms of each token's residual stream [BLOCK_M]; the `writer` program also stores the stream. Wide tiles
    and a pipelined loop: every program waits for this before its first weight load."""
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] & (k < K)[None, :]
        h = _stream(x_ptr, res_ptr, rm, k, mask, stride_xm, stride_rm, ADD_RESIDUAL)
        if ADD_RESIDUAL:
            tl.store(new_res_ptr + rm.to(tl.int64)[:, None] * K + k[None, :], h, mask=mask & writer)
        h = h.to(tl.float32)
        total += tl.sum(h * h, 1)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _activation(x_ptr, res_ptr, nw_ptr, rm, k, mask, K, stride_xm, stride_rm, inv_rms,
                PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """The product's left operand [BLOCK_M, BLOCK_K] in the activation dtype, rounded where the unfused kernels
    round it."""
    if PROLOGUE == 2:  # silu(gate) * up: gate at [0, K), up at [K, 2K) of each row
        gate = _rows(x_ptr, rm, k, mask, stride_xm).to(tl.float32)
        up = _rows(x_ptr + K, rm, k, mask, stride_xm).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    if PROLOGUE == 1:
        h = _stream(x_ptr, res_ptr, rm, k, mask, stride_xm, stride_rm, ADD_RESIDUAL).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return (h * inv_rms[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    return _rows(x_ptr, rm, k, mask, stride_xm)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_rm,
                 stride_wn, stride_om, stride_split, k_per_split, eps,
                 PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STATS_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, res_ptr, new_res_ptr, rm, m_ok, K, stride_xm, stride_rm, eps,
                           (pid_n == 0) & (pid_k == 0), ADD_RESIDUAL, BLOCK_M, STATS_K, STAGES)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if BLOCK_M == 1:  # CUDA cores: elementwise products, summed across K once after the loop
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: only the last tile of K is partial
    for k0 in tl.range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = _activation(x_ptr, res_ptr, nw_ptr, rm, k, m_ok[:, None] & k_ok[None, :], K, stride_xm, stride_rm,
                        inv_rms, PROLOGUE, ADD_RESIDUAL)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * a.to(tl.float32)
        elif UPCAST:  # Triton 3.6's interpreter multiplies bf16 operands as raw integers; fp32 copies are exact
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if BLOCK_M == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = acc
    mask = m_ok[:, None] & n_ok[None, :]
    offsets = rm[:, None] * stride_om + rn[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_split + offsets, out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, N, stride_split, stride_pm, stride_ym,
                       SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m] = sum over splits of the fp32 partials, in split order (+ bias), rounded once."""
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * stride_split + m * stride_pm + rn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, w: torch.Tensor, k: int, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or not 0 <= x.shape[0] <= GEMV_MAX_TOKENS or x.stride(-1) != 1:
        raise ValueError(f"the fused GEMVs take x [tokens <= {GEMV_MAX_TOKENS}, features] with unit column stride, "
                         f"got {tuple(x.shape)} with strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"the fused GEMVs take bf16 or fp16 activations and weights of the same dtype, got "
                         f"{x.dtype} and {w.dtype}")
    if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"the weight must be [out, {k}] with unit column stride, got {tuple(w.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")


def _launch(prologue: int, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, launch: GemvLaunch | None,
            residual: torch.Tensor | None = None, new_residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    (m, n), k = (x.shape[0], w.shape[0]), w.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    launch = launch or default_launch(m, n, k)
    block_k = min(launch.block_k, triton.next_power_of_2(k))
    block_m, block_n = (1, launch.block_n) if m == 1 else (_DOT_ROWS, max(16, launch.block_n))
    splits = min(launch.split_k, triton.cdiv(k, block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # no split left without inputs
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else x  # placeholder pointers where a prologue reads none
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, res, new_residual if new_residual is not None else x, norm_weight if norm_weight is not None else w, w,
        bias if bias is not None else w, out, m, n, k, x.stride(0), res.stride(0), w.stride(0), n, m * n,
        k_per_split, eps, PROLOGUE=prologue, ADD_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        PARTIAL=splits > 1, UPCAST=_INTERPRETED and x.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, STATS_K=min(triton.next_power_of_2(k), _STATS_ELEMENTS // block_m), STAGES=launch.num_stages,
        num_warps=launch.num_warps)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, _SUM_BLOCK), m)](
            out, bias if bias is not None else y, y, n, m * n, n, n, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=_SUM_BLOCK, num_warps=4)
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         launch: GemvLaunch | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_TOKENS) -> F.linear(x, w, bias) [M, N]."""
    _check(x, w, x.shape[-1] if x.dim() else 0, bias)
    return _launch(_NONE, x, w, bias, launch)


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
              residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              launch: GemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(h), w, bias), h) where h = x + residual (rounded to the activation dtype), or x where
    residual is None: RMSNorm's forward (model/layers/norm.py) and the next projection in one launch. x and
    residual are left as they are; the new residual stream is a new tensor."""
    _check(x, w, x.shape[-1] if x.dim() else 0, bias)
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} ({x.dtype}) with unit column stride, got "
                         f"{tuple(residual.shape)} ({residual.dtype})")
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = _launch(_NORM, x, w, bias, launch, residual, new_residual, norm_weight, eps)
    return y, new_residual


def silu_mul_gemv(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  launch: GemvLaunch | None = None) -> torch.Tensor:
    """gate_up [M, 2 I] (gate first, as LlamaMLP's gate_up_proj) -> F.linear(silu(gate) * up, w, bias) [M, N],
    the activation computed in fp32 and rounded once, as kernels/triton/activation.py's."""
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * I], got {tuple(gate_up.shape)}")
    _check(gate_up, w, width // 2, bias)
    return _launch(_SILU, gate_up, w, bias, launch)
