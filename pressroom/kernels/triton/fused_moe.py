"""Fused mixture-of-experts on the GPU: the (token, expert) pairs sorted by expert and padded to blocks of
BLOCK_M rows, then two grouped GEMMs over those blocks, each block reading one expert's weights:
gate and up with SiLU-and-mul in the same pass, then down with each pair's top-k weight applied; a sum
over the k pairs of a token gives its output.

Shapes are static for a given (tokens, top_k, experts): the padded pair list has its upper bound
tokens * top_k + experts * (BLOCK_M - 1) slots, and blocks past the used ones carry expert -1 and exit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [tokens, k]: expert ids local to this rank (-1: another rank's expert). Returns slots
    [max_padded] (pair index t * k + j grouped by expert, each expert's run padded to a multiple of
    block_m with tokens * k) and block_expert [max_padded // block_m] (each block's expert; -1: unused).
    No host sync: every size is known from the shapes."""
    pairs, device = ids.numel(), ids.device
    key = torch.where(ids.reshape(-1) >= 0, ids.reshape(-1), num_experts)  # other ranks' pairs sort last
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # bincount would sync with the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in the sorted order
    max_padded = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    expert = sorted_key.clamp(max=num_experts - 1)
    dest = ends[expert] - padded[expert] + torch.arange(pairs, device=device) - first[expert]
    dest = torch.where(sorted_key < num_experts, dest, max_padded)  # dropped pairs land in a spare slot
    slots = torch.full((max_padded + 1,), pairs, dtype=torch.int32, device=device)
    slots.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(max_padded // block_m, device=device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return slots[:max_padded], torch.where(block_expert < num_experts, block_expert, -1)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, weights_ptr,
                     n_out, k_in, num_pairs, stride_a, stride_we, stride_wn, stride_c, top_k,
                     A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    valid = slot < num_pairs
    a_row = slot // top_k if A_BY_TOKEN else slot
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = k0 + ks < k_in
        a = tl.load(a_ptr + a_row.to(tl.int64)[:, None] * stride_a + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_base + (cols + n_out)[None, :] * stride_wn + (k0 + ks)[:, None],
                           mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + slot, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + slot.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights (fp32) and ids [T, k], ids local to w13's experts
    (-1: another rank's expert). Returns [T, H] in x's dtype."""
    tokens, hidden = x.shape
    experts, double_inter, _ = w13.shape
    inter, k = double_inter // 2, ids.shape[1]
    pairs = tokens * k
    slots, block_expert = align_by_expert(ids, experts, block_m)
    mid = torch.zeros(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models keep fp32 products
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _moe_gemm_kernel[grid](x, w13, mid, slots, block_expert, flat_weights, inter, hidden, pairs,
                           x.stride(0), w13.stride(0), w13.stride(1), mid.stride(0), k,
                           A_BY_TOKEN=True, GATED=True, MUL_WEIGHTS=False, PRECISION=precision,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    grid = (block_expert.numel(), triton.cdiv(hidden, block_n))
    _moe_gemm_kernel[grid](mid, w2, out, slots, block_expert, flat_weights, hidden, inter, pairs,
                           mid.stride(0), w2.stride(0), w2.stride(1), out.stride(0), k,
                           A_BY_TOKEN=False, GATED=False, MUL_WEIGHTS=True, PRECISION=precision,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(tokens, k, hidden).sum(dim=1)
