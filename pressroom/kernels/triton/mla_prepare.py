"""MLA's absorbed query and cache entry in one launch, after the projections and the W_UK bmm.

Replaces, per layer, the latent's contiguous copy, kv_a_layernorm, the concatenation of the rope parts,
the rotary pass and the two concatenations of the result. Each token gets a few programs: all but the
last copy a block of heads' latent queries and rotate those heads' rope parts; the last normalises the
KV latent and rotates the shared key. The math follows the kernels it replaces (norm.py's RMSNorm and
rotary.py's rotation): fp32 throughout, one rounding at the store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 4096  # elements of latent query one program copies at most (heads x padded rank)


@triton.jit
def _rotated_halves(src, cos, sin, mask, HALF: tl.constexpr):
    """Both halves of a rotate-half rotation of the rope dims at src (fp32)."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _write_entry(kv_ptr, weight_ptr, entry_ptr, cos, sin, token, stride_kvt, stride_et, rank, eps,
                 RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The token's cache entry: RMSNorm of the KV latent (as norm.py's kernel computes it), rotated key."""
    cols = tl.arange(0, RANK_PAD)
    col_ok = cols < rank
    x = tl.load(kv_ptr + token * stride_kvt + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / rank + eps)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    entry = entry_ptr + token * stride_et
    tl.store(entry + cols, (x * inv_rms * w).to(entry_ptr.dtype.element_ty), mask=col_ok)
    half = tl.arange(0, HALF_PAD)
    half_ok = half < HALF
    first, second = _rotated_halves(kv_ptr + token * stride_kvt + rank + half, cos, sin, half_ok, HALF)
    tl.store(entry + rank + half, first.to(entry_ptr.dtype.element_ty), mask=half_ok)
    tl.store(entry + rank + HALF + half, second.to(entry_ptr.dtype.element_ty), mask=half_ok)


@triton.jit
def _write_queries(q_ptr, q_latent_ptr, query_ptr, cos, sin, token, head_block, stride_qt, stride_qh, stride_lh,
                   stride_lt, stride_yt, stride_yh, num_heads, nope, rank,
                   RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """A block of heads' queries: the latent query copied, the rope part rotated behind it."""
    heads = (head_block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # heads x tokens x rank may pass 2^31
    head_ok = (heads < num_heads)[:, None]
    cols = tl.arange(0, RANK_PAD)
    mask = head_ok & (cols < rank)[None, :]
    query = query_ptr + token * stride_yt + heads[:, None] * stride_yh
    latent = tl.load(q_latent_ptr + heads[:, None] * stride_lh + token * stride_lt + cols[None, :], mask=mask)
    tl.store(query + cols[None, :], latent.to(query_ptr.dtype.element_ty), mask=mask)
    half = tl.arange(0, HALF_PAD)
    rope_mask = head_ok & (half < HALF)[None, :]
    pe = q_ptr + token * stride_qt + heads[:, None] * stride_qh + nope + half[None, :]
    first, second = _rotated_halves(pe, cos[None, :], sin[None, :], rope_mask, HALF)
    tl.store(query + rank + half[None, :], first.to(query_ptr.dtype.element_ty), mask=rope_mask)
    tl.store(query + rank + HALF + half[None, :], second.to(query_ptr.dtype.element_ty), mask=rope_mask)


@triton.jit
def _mla_prepare_kernel(q_ptr, q_latent_ptr, kv_ptr, weight_ptr, cos_ptr, sin_ptr, query_ptr, entry_ptr,
                        stride_qt, stride_qh, stride_lh, stride_lt, stride_kvt, stride_ct, stride_st,
                        stride_yt, stride_yh, stride_et, num_heads, nope, rank, eps,
                        RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    half = tl.arange(0, HALF_PAD)
    half_ok = half < HALF
    cos = tl.load(cos_ptr + token * stride_ct + half, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + half, mask=half_ok, other=0.0).to(tl.float32)
    # each branch in its own function: the compiler refuses names bound to differently shaped values in both
    if head_block * BLOCK_H >= num_heads:  # the token's last program
        _write_entry(kv_ptr, weight_ptr, entry_ptr, cos, sin, token, stride_kvt, stride_et, rank, eps,
                     RANK_PAD, HALF, HALF_PAD)
    else:
        _write_queries(q_ptr, q_latent_ptr, query_ptr, cos, sin, token, head_block, stride_qt, stride_qh, stride_lh,
                       stride_lt, stride_yt, stride_yh, num_heads, nope, rank, RANK_PAD, HALF, HALF_PAD, BLOCK_H)


def _check_shapes(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, heads, _ = q.shape
    rank, rope = q_latent.shape[-1], 2 * cos.shape[-1]
    if q_latent.shape != (heads, tokens, rank) or kv.shape != (tokens, rank + rope) or weight.shape != (rank,):
        raise ValueError(f"mla_prepare needs q_latent [heads, tokens, rank], kv [tokens, rank + rope] and weight "
                         f"[rank]; got q {tuple(q.shape)}, q_latent {tuple(q_latent.shape)}, kv {tuple(kv.shape)}, "
                         f"weight {tuple(weight.shape)} with rope {rope}")
    if cos.shape != (tokens, rope // 2) or sin.shape != cos.shape or q.shape[-1] < rope:
        raise ValueError(f"cos and sin must be [tokens, rope / 2] = [{tokens}, {rope // 2}] and q at least rope wide")
    if any(t.stride(-1) != 1 for t in (q, q_latent, kv, cos, sin)) or not weight.is_contiguous():
        raise ValueError("mla_prepare needs unit stride in the last dimension of every input")
    if q.dtype != q_latent.dtype:  # the old path's cat would have promoted; the model never mixes them
        raise ValueError(f"q ({q.dtype}) and q_latent ({q_latent.dtype}) must share a dtype")


def mla_prepare(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From q [T, heads, nope + rope] (only its rope part is read; row strides free), the absorbed
    q_latent [heads, T, rank], kv_a_proj_with_mqa's kv [T, rank + rope], kv_a_layernorm's weight [rank]
    and eps, and the rope tables cos, sin [T, rope / 2] (rotate-half over all rope dims): returns
    query [T, heads, rank + rope] = cat(q_latent^T, rotate(q rope)) in q_latent's dtype and
    entry [T, rank + rope] = cat(rms_norm(kv latent) * weight, rotate(kv rope)) in kv's dtype.
    Reference: tests/kernels/test_triton_mla_prepare.py's prepare_reference."""
    _check_shapes(q, q_latent, kv, norm_weight, cos, sin)
    tokens, heads, width = q.shape
    rank, half = q_latent.shape[-1], cos.shape[-1]
    query = torch.empty(tokens, heads, rank + 2 * half, dtype=q_latent.dtype, device=q.device)
    entry = torch.empty(tokens, rank + 2 * half, dtype=kv.dtype, device=kv.device)
    if tokens == 0:
        return query, entry
    rank_pad = triton.next_power_of_2(rank)
    block_h = min(triton.next_power_of_2(heads), max(1, _TILE // rank_pad))
    # num_warps=4, as norm.py's kernel for rank <= 1024: the same reduction layout, so the same sum
    _mla_prepare_kernel[(tokens, triton.cdiv(heads, block_h) + 1)](
        q, q_latent, kv, norm_weight, cos, sin, query, entry,
        q.stride(0), q.stride(1), q_latent.stride(0), q_latent.stride(1), kv.stride(0), cos.stride(0), sin.stride(0),
        query.stride(0), query.stride(1), entry.stride(0), heads, width - 2 * half, rank, eps,
        RANK_PAD=rank_pad, HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=4)
    return query, entry
