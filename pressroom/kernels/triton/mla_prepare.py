"""MLA's absorbed query and cache entry in one launch, after the projections and the W_UK bmm.

Replaces, per layer, the latent's contiguous copy, kv_a_layernorm, the concatenation of the rope parts,
the rotary pass and the two concatenations of the result. Each token gets a few programs: all but the
last copy a block of heads' latent queries and rotate those heads' rope parts; the last normalises the
KV latent and rotates the shared key. The math follows the kernels it replaces (norm.py's RMSNorm and
rotary.py's rotation): fp32 throughout, one rounding at the store.

DSA layers (V3.2) also hand over the indexer's key as wk made it: the entry's last part is its LayerNorm and
rotation (nn.LayerNorm, the rotary pass and the entry's concatenation in the replaced sequence), and the entry
goes straight into its cache slot (`mla_prepare_into_cache`: write_kv's launch too); the indexer's queries are
rotated in the same launch (programs after the entry's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton.cache import saturation_limit

_TILE = 4096  # elements of latent query one program copies at most (heads x padded rank)


@triton.jit
def _rotated_halves(src, cos, sin, mask, HALF: tl.constexpr):
    """Both halves of a rotate-half rotation of the rope dims at src (fp32)."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store(dst, value, mask, like_ptr, LIMIT: tl.constexpr):
    """value (fp32) rounded to like_ptr's element type (the model's: what the replaced kernels stored), then, for an
    FP8 destination (LIMIT > 0), saturated and converted as cache.py's write_kv does."""
    value = value.to(like_ptr.dtype.element_ty)
    if LIMIT > 0:
        value = tl.clamp(value.to(tl.float32), -LIMIT, LIMIT)
    tl.store(dst, value.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_entry(kv_ptr, weight_ptr, entry, ok, cos, sin, token, stride_kvt, rank, eps,
                 RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, LIMIT: tl.constexpr):
    """The token's cache entry at `entry` (written where `ok`): RMSNorm of the KV latent (as norm.py's kernel
    computes it), rotated key."""
    cols = tl.arange(0, RANK_PAD)
    col_ok = cols < rank
    x = tl.load(kv_ptr + token * stride_kvt + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / rank + eps)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    _store(entry + cols, x * inv_rms * w, col_ok & ok, kv_ptr, LIMIT)
    half = tl.arange(0, HALF_PAD)
    half_ok = half < HALF
    first, second = _rotated_halves(kv_ptr + token * stride_kvt + rank + half, cos, sin, half_ok, HALF)
    _store(entry + rank + half, first, half_ok & ok, kv_ptr, LIMIT)
    _store(entry + rank + HALF + half, second, half_ok & ok, kv_ptr, LIMIT)


@triton.jit
def _layer_normed(src, w_ptr, b_ptr, mean, rstd, mask):
    """LayerNorm of the values at src (fp32 statistics given), rounded to their dtype as nn.LayerNorm's output is."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
    return ((x - mean) * rstd * w + b).to(src.dtype.element_ty).to(tl.float32)


@triton.jit
def _write_indexer_key(key_ptr, w_ptr, b_ptr, dst, ok, cos, sin, token, stride_keyt, dim, eps,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr, LIMIT: tl.constexpr):
    """DSA's indexer key: LayerNorm (two-pass fp32 statistics), then rotate-half over its first 2 * HALF dims."""
    row = key_ptr + token * stride_keyt
    cols = tl.arange(0, DIM_PAD)
    col_ok = cols < dim
    x = tl.load(row + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / dim
    centred = tl.where(col_ok, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 0) / dim + eps)
    half = tl.arange(0, HALF_PAD)
    half_ok = half < HALF
    x1 = _layer_normed(row + half, w_ptr + half, b_ptr + half, mean, rstd, half_ok)
    x2 = _layer_normed(row + HALF + half, w_ptr + HALF + half, b_ptr + HALF + half, mean, rstd, half_ok)
    _store(dst + half, x1 * cos - x2 * sin, half_ok & ok, key_ptr, LIMIT)
    _store(dst + HALF + half, x2 * cos + x1 * sin, half_ok & ok, key_ptr, LIMIT)
    rest = col_ok & (cols >= 2 * HALF)
    _store(dst + cols, _layer_normed(row + cols, w_ptr + cols, b_ptr + cols, mean, rstd, rest), rest & ok, key_ptr,
           LIMIT)


@triton.jit
def _rotate_heads(x_ptr, cos, sin, token, block, stride_xt, stride_xh, num_heads, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """rotary.py's pass over a block of heads of x, in place (DSA's indexer queries)."""
    heads = (block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    half = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (half < HALF)[None, :]
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + half[None, :]
    x1, x2 = _rotated_halves(first, cos[None, :], sin[None, :], mask, HALF)
    tl.store(first, x1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, x2.to(x_ptr.dtype.element_ty), mask=mask)


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
def _mla_prepare_kernel(q_ptr, q_latent_ptr, kv_ptr, weight_ptr, cos_ptr, sin_ptr, query_ptr, entry_ptr, slot_ptr,
                        key_ptr, key_w_ptr, key_b_ptr, iq_ptr,
                        stride_qt, stride_qh, stride_lh, stride_lt, stride_kvt, stride_ct, stride_st,
                        stride_yt, stride_yh, stride_et, stride_keyt, stride_iqt, stride_iqh, num_heads, nope, rank,
                        eps, key_dim, key_eps, index_heads,
                        RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                        BLOCK_H: tl.constexpr, KEY_PAD: tl.constexpr, HAS_KEY: tl.constexpr,
                        INDEX_BLOCK_H: tl.constexpr, TO_CACHE: tl.constexpr, LIMIT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    half = tl.arange(0, HALF_PAD)
    half_ok = half < HALF
    cos = tl.load(cos_ptr + token * stride_ct + half, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + half, mask=half_ok, other=0.0).to(tl.float32)
    # programs per token: blocks of heads' queries, the entry, then blocks of the indexer's queries (DSA)
    # each branch in its own function: the compiler refuses names bound to differently shaped values in both
    query_blocks = tl.cdiv(num_heads, BLOCK_H)
    if head_block > query_blocks:
        _rotate_heads(iq_ptr, cos, sin, token, head_block - query_blocks - 1, stride_iqt, stride_iqh, index_heads,
                      HALF, HALF_PAD, INDEX_BLOCK_H)
    elif head_block == query_blocks:
        if TO_CACHE:  # the entry's row is its cache slot; a negative slot is a padding row, written nowhere
            row = tl.load(slot_ptr + token).to(tl.int64)
        else:
            row = token
        ok = row >= 0
        entry = entry_ptr + tl.maximum(row, 0) * stride_et
        _write_entry(kv_ptr, weight_ptr, entry, ok, cos, sin, token, stride_kvt, rank, eps, RANK_PAD, HALF,
                     HALF_PAD, LIMIT)
        if HAS_KEY:
            _write_indexer_key(key_ptr, key_w_ptr, key_b_ptr, entry + rank + 2 * HALF, ok, cos, sin, token,
                               stride_keyt, key_dim, key_eps, HALF, HALF_PAD, KEY_PAD, LIMIT)
    else:
        _write_queries(q_ptr, q_latent_ptr, query_ptr, cos, sin, token, head_block, stride_qt, stride_qh, stride_lh,
                       stride_lt, stride_yt, stride_yh, num_heads, nope, rank, RANK_PAD, HALF, HALF_PAD, BLOCK_H)


@dataclass(frozen=True, slots=True)
class IndexerInputs:
    """DSA's indexer key as wk made it, for the entry's last part: key [T, dim] (row stride free) and its LayerNorm's
    weight and bias [dim] and eps; the first rope dims are rotated after the norm. `queries` [T, index_heads, dim]
    (dims 1, 2 dense), where given, are rotated in place as rotary.py's pass would (their rotary launch)."""
    key: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float
    queries: torch.Tensor | None = None


def _check_shapes(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, index_key: IndexerInputs | None) -> None:
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
    if index_key is not None:
        key, dim = index_key.key, index_key.key.shape[-1]
        if key.shape != (tokens, dim) or key.stride(-1) != 1 or dim < rope or \
                index_key.weight.shape != (dim,) or index_key.bias.shape != (dim,):
            raise ValueError(f"the indexer key must be [tokens, dim >= {rope}] with unit stride in dim and its norm's "
                             f"weight and bias [dim]; got key {tuple(key.shape)}, weight "
                             f"{tuple(index_key.weight.shape)}, bias {tuple(index_key.bias.shape)}")
        queries = index_key.queries
        if queries is not None and (queries.dim() != 3 or queries.shape[0] != tokens or queries.shape[-1] < rope
                                    or queries.stride(2) != 1 or queries.stride(1) != queries.shape[2]):
            raise ValueError(f"the indexer queries must be [{tokens}, heads, dim >= {rope}] with dims 1 and 2 dense; "
                             f"got {tuple(queries.shape)}")


def _launch(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
            cos: torch.Tensor, sin: torch.Tensor, index_key: IndexerInputs | None, entries: torch.Tensor,
            slot_mapping: torch.Tensor | None) -> torch.Tensor:
    """The query, with each token's entry written into row `slot_mapping[t]` of entries (row t without it)."""
    _check_shapes(q, q_latent, kv, norm_weight, cos, sin, index_key)
    tokens, heads, width = q.shape
    rank, half = q_latent.shape[-1], cos.shape[-1]
    query = torch.empty(tokens, heads, rank + 2 * half, dtype=q_latent.dtype, device=q.device)
    if tokens == 0:
        return query
    rank_pad = triton.next_power_of_2(rank)
    block_h = min(triton.next_power_of_2(heads), max(1, _TILE // rank_pad))
    key = index_key or IndexerInputs(kv, norm_weight, norm_weight, 0.0)  # placeholders the kernel never reads
    key_dim = key.key.shape[-1] if index_key else 0
    index_q = key.queries if key.queries is not None else q  # a placeholder where there are none
    index_heads = index_q.shape[1] if key.queries is not None else 0
    index_block_h = min(16, triton.next_power_of_2(max(index_heads, 1)))  # rotary.py's heads per program
    # num_warps=4, as norm.py's kernel for rank <= 1024: the same reduction layout, so the same sum
    programs = triton.cdiv(heads, block_h) + 1 + triton.cdiv(index_heads, index_block_h)
    _mla_prepare_kernel[(tokens, programs)](
        q, q_latent, kv, norm_weight, cos, sin, query, entries, kv if slot_mapping is None else slot_mapping,
        key.key, key.weight, key.bias, index_q,
        q.stride(0), q.stride(1), q_latent.stride(0), q_latent.stride(1), kv.stride(0), cos.stride(0), sin.stride(0),
        query.stride(0), query.stride(1), entries.stride(0), key.key.stride(0), index_q.stride(0), index_q.stride(1),
        heads, width - 2 * half, rank, eps, key_dim, key.eps, index_heads, RANK_PAD=rank_pad, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, KEY_PAD=triton.next_power_of_2(max(key_dim, 1)),
        HAS_KEY=index_key is not None, INDEX_BLOCK_H=index_block_h, TO_CACHE=slot_mapping is not None,
        LIMIT=saturation_limit(entries.dtype), num_warps=4)
    return query


def mla_prepare(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, index_key: IndexerInputs | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """From q [T, heads, nope + rope] (only its rope part is read; row strides free), the absorbed
    q_latent [heads, T, rank], kv_a_proj_with_mqa's kv [T, rank + rope], kv_a_layernorm's weight [rank]
    and eps, and the rope tables cos, sin [T, rope / 2] (rotate-half over all rope dims): returns
    query [T, heads, rank + rope] = cat(q_latent^T, rotate(q rope)) in q_latent's dtype and
    entry [T, rank + rope] = cat(rms_norm(kv latent) * weight, rotate(kv rope)) in kv's dtype, followed by
    rotate(layer_norm(key)) [T, dim] where `index_key` is given (DSA; its queries rotated in place).
    Reference: tests/kernels/test_triton_mla_prepare.py's prepare_reference."""
    dim = index_key.key.shape[-1] if index_key is not None else 0
    entry = torch.empty(q.shape[0], q_latent.shape[-1] + 2 * cos.shape[-1] + dim, dtype=kv.dtype, device=kv.device)
    return _launch(q, q_latent, kv, norm_weight, eps, cos, sin, index_key, entry, None), entry


def mla_prepare_into_cache(q: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor, index_key: IndexerInputs | None,
                           cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """mla_prepare with each token's entry written straight into its slot of cache [blocks, block_size, 1, width]
    (the cache write of the replaced sequence, cache.py's write_kv: FP8 saturates, negative slots are padding rows
    and are skipped) instead of returned; returns the query."""
    dim = index_key.key.shape[-1] if index_key is not None else 0
    entry_width = q_latent.shape[-1] + 2 * cos.shape[-1] + dim
    if cache.dim() != 4 or cache.shape[2] != 1 or not cache.is_contiguous() or cache.shape[-1] != entry_width:
        raise ValueError(f"the latent cache must be a contiguous [blocks, block_size, 1, {entry_width}] tensor; got "
                         f"{tuple(cache.shape)}")
    if slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"slot_mapping must hold one slot per token ({q.shape[0]}); got {tuple(slot_mapping.shape)}")
    return _launch(q, q_latent, kv, norm_weight, eps, cos, sin, index_key, cache.view(-1, entry_width), slot_mapping)
