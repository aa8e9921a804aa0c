"""A batch-invariant matmul, y = x @ w.T (+ bias): every output element's reduction over K runs in one fixed
order whatever the number of rows M, so a row's bits do not depend on which other rows share its batch.

cuBLAS picks its algorithm (tile shape, split-K, its reduction order) by the problem's shape, M included;
here the tile shape, warps and stages come from (N, K) only, K is walked in order in BLOCK_K steps by the one
program that owns the output tile (no split-K), and M is never specialised on (a Triton int argument equal to
1 or divisible by 16 would otherwise compile a different kernel). Used for every linear layer and the LM head
under `--batch-invariant` on CUDA (kernels/batch_invariant.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting

_INTERPRETED = interpreting()
_SMS = 132  # an H100/H200's multiprocessors: below this many N tiles a decode-sized M leaves SMs idle


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Triton 3.6's interpreter multiplies bf16 operands as raw 16-bit integers; fp32 copies give the same products.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Grouped tile order (GROUP_M row tiles share each weight tile while it is in L2); the order decides only
    # which program computes a tile, never how.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K  # the K tail reads zeros: adding 0 products changes no sum
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot_acc(a, b, acc, UPCAST, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def matmul_config(n: int, k: int) -> MatmulConfig:
    """Tiles from the weight's shape only, never from M. 64 rows per tile: a decode's few rows waste less of
    it than of 128; 128 columns where N gives enough tiles to fill the SMs at one row tile, else 64 (an 8B
    model's 4096-wide o_proj and down_proj: 64 tiles, not 32)."""
    block_n = 128 if n >= 128 * _SMS else 64
    return MatmulConfig(block_m=64, block_n=block_n, block_k=64, group_m=8, num_warps=4, num_stages=4)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) in x's dtype, fp32 accumulation; a row's result is the same
    bits for any number of rows beside it (reference: F.linear). `config`: tiles other than matmul_config's
    (benchmarks/gpu/batch_invariant.py sweeps them); invariance holds for any one config kept fixed."""
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(1) != 1 or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"invariant_matmul needs x [..., {k}], weight [N, K] with unit column stride and bias "
                         f"[N]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    cfg = config or matmul_config(n, k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, UPCAST=_INTERPRETED and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*lead, n)
