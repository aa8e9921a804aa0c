"""Dense GEMVs for decode steps of one token, with the op before each projection in their prologue: RMSNorm (and
the residual add) before qkv and gate_up, SwiGLU's silu(gate) * up before down.

A decode step of a dense model reads every weight once and does two flops per weight: it is bound by memory, and at
batch 1 of an 8B model the separate norm and activation kernels between cuBLAS's GEMMs cost launches and gaps
(docs/BENCHMARKS.md's profile). Here one launch does each projection with what comes before it:

- A program owns block_n weight rows (bf16/fp16 [N, K] row-major) and walks K in block_k tiles, multiplying and
  adding on the CUDA cores into an fp32 [block_n, block_k] accumulator summed across K once at the end.
- `norm_gemv`: each program first recomputes the token's mean square (x is 8 KB at 4,096 inputs, read from L2) and
  program 0 writes the new residual stream (x + residual) to a fresh tensor; other programs must still read the
  old one, so it is never updated in place. The normalised activation is rounded to the activation dtype before
  the product, exactly where kernels/triton/norm.py's RMSNorm rounds it, so the result equals RMSNorm then F.linear
  up to the GEMM's summation order.
- `silu_mul_gemv`: silu(gate) * up in fp32 rounded once (kernels/triton/activation.py's), gate_up [1, 2 I] as
  LlamaMLP's fused projection lays it out (gate first).

Measured (benchmarks/gpu/norm_gemv.py, H100, 2026-12-07; docs/BENCHMARKS.md): at one token and Llama-3.1-8B's
shapes these run 2-14% faster than the norm/activation kernel + cuBLAS they replace (qkv 20.4 against 22.1 us, o
13.2 against 15.1, gate_up 78.7 against 80.2, down 40.0 against 43.3); splitting K over several programs never
helped at one token, so there is no split-K. A 2-8 token variant through tl.dot (tokens padded to 16 rows)
ran at 0.52-0.72x the unfused kernels on qkv, gate_up and down (o even) and was removed. To try next for 2-4
tokens: this CUDA-core loop over up to 4 token rows a weight tile (each tile loaded once, an accumulator a row),
swept against the unfused kernels before GEMV_MAX_TOKENS is raised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GEMV_MAX_TOKENS = 1  # the one home of the rule: steps of at most this many tokens take these kernels
_NONE, _NORM, _SILU = 0, 1, 2  # the prologue
_STATS_ELEMENTS = 8192  # the norm's statistics pass reads tiles of this many activations (one pass at 4,096 inputs)


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


def sweep_launches() -> list[GemvLaunch]:
    """The launches benchmarks/gpu/norm_gemv.py times for each shape (DEFAULT_LAUNCHES' candidates): tiles of 4K to
    16K weights over 4 to 32 rows (more rows a program: fewer re-reads of the activations from L2)."""
    tiles = [(4, 2048, 4), (8, 512, 4), (8, 1024, 4), (8, 2048, 8), (16, 512, 4), (16, 1024, 8), (32, 512, 8)]
    return [GemvLaunch(block_n, block_k, warps) for block_n, block_k, warps in tiles]


def shape_class(n: int, k: int) -> str:
    """'tall' for many short rows (gate_up), 'long' for few long rows (down), 'wide' for more rows than inputs
    (qkv), else 'square' (o)."""
    if n >= 4 * k:
        return "tall"
    if k >= 2 * n:
        return "long"
    return "wide" if n > k else "square"


def default_launch(n: int, k: int) -> GemvLaunch:
    return DEFAULT_LAUNCHES[shape_class(n, k)]


@triton.jit
def _stream(x_ptr, res_ptr, k, mask, ADD_RESIDUAL: tl.constexpr):
    """The residual stream's tile [1, BLOCK]: x + residual rounded to the residual's dtype (as torch's
    `x + residual`), or x."""
    x = tl.load(x_ptr + k[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + k[None, :], mask=mask, other=0.0).to(tl.float32)
             ).to(res_ptr.dtype.element_ty)
    return x


@triton.jit
def _inv_rms(x_ptr, res_ptr, new_res_ptr, K, eps, writer, ADD_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
             STAGES: tl.constexpr):
    """1 / rms of the token's residual stream [1]; the `writer` program also stores the stream. Wide tiles and a
    pipelined loop: every program waits for this before its first weight load."""
    total = tl.zeros((1,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (k < K)[None, :]
        h = _stream(x_ptr, res_ptr, k, mask, ADD_RESIDUAL)
        if ADD_RESIDUAL:
            tl.store(new_res_ptr + k[None, :], h, mask=mask & writer)
        h = h.to(tl.float32)
        total += tl.sum(h * h, 1)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _activation(x_ptr, res_ptr, nw_ptr, k, mask, K, inv_rms, PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """The product's left operand [1, BLOCK_K] in the activation dtype, rounded where the unfused kernels round
    it."""
    if PROLOGUE == 2:  # silu(gate) * up: gate at [0, K), up at [K, 2K)
        gate = tl.load(x_ptr + k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    if PROLOGUE == 1:
        h = _stream(x_ptr, res_ptr, k, mask, ADD_RESIDUAL).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return (h * inv_rms[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptr + k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, eps,
                 PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    inv_rms = tl.zeros((1,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, res_ptr, new_res_ptr, K, eps, pid_n == 0, ADD_RESIDUAL, STATS_K, STAGES)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # elementwise products, summed across K after the loop
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = _activation(x_ptr, res_ptr, nw_ptr, k, k_ok[None, :], K, inv_rms, PROLOGUE, ADD_RESIDUAL)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check(x: torch.Tensor, w: torch.Tensor, k: int, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or not 0 <= x.shape[0] <= GEMV_MAX_TOKENS or x.stride(-1) != 1:
        raise ValueError(f"the fused GEMVs take x [tokens <= {GEMV_MAX_TOKENS}, features] with unit column stride "
                         f"(larger steps: the modules' forwards), got {tuple(x.shape)} with strides {x.stride()}")
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
    launch = launch or default_launch(n, k)
    block_k = min(launch.block_k, triton.next_power_of_2(k))
    res = residual if residual is not None else x  # placeholder pointers where a prologue reads none
    _gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, res, new_residual if new_residual is not None else x, norm_weight if norm_weight is not None else w, w,
        bias if bias is not None else w, y, n, k, w.stride(0), eps, PROLOGUE=prologue,
        ADD_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        STATS_K=min(triton.next_power_of_2(k), _STATS_ELEMENTS), STAGES=launch.num_stages,
        num_warps=launch.num_warps)
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         launch: GemvLaunch | None = None) -> torch.Tensor:
    """x [1, K] -> F.linear(x, w, bias) [1, N]."""
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
    """gate_up [1, 2 I] (gate first, as LlamaMLP's gate_up_proj) -> F.linear(silu(gate) * up, w, bias) [1, N],
    the activation computed in fp32 and rounded once, as kernels/triton/activation.py's."""
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * I], got {tuple(gate_up.shape)}")
    _check(gate_up, w, width // 2, bias)
    return _launch(_SILU, gate_up, w, bias, launch)
