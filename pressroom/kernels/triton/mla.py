"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over a paged latent cache, a mixed batch in one
launch, with optional split-KV for decodes.

Every query head reads the same cache entry per token: the latent (`latent_dim` values, also the value vector)
followed by the rotated shared key (`rope_dim` values), and, for DSA layers, the indexer's key, which this
kernel never reads. A query is the head's latent-space query then its rotated rope part, so a score is
q_latent . latent + q_rope . key_rope, and the output is the softmax mix of latents [tokens, heads, latent_dim].
Splitting each key into its two parts keeps the tiles at powers of two (512 + 64, not 576 padded to 1024).

Packing as in attention.py: one program serves BLOCK_Q query tokens of one request times BLOCK_H heads (the M
rows of tl.dot), walks the context in tiles of TILE_N tokens through the block table with an online softmax
in the exp2 domain, and split-KV partials merge in attention.py's merge kernel. The launch reads only shapes
and host ints, so a CUDA graph captured once replays for any context lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting
from pressroom.kernels.triton.attention import (
    _LOG2E,
    MIN_SPLIT_TILES,
    _context_span,
    _dot,
    _locate,
    _query_rows,
    _request_queries,
    _softmax_step,
    _split_tokens,
    _write_rows,
    merge_splits,
    query_blocks,
    split_partials,
)

_INTERPRETED = interpreting()


@triton.jit
def _latent_query(q_row, row_ok, LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr,
                  ROPE_PAD: tl.constexpr, FP8_CACHE: tl.constexpr):
    """Each row's latent-space query [rows, LATENT_PAD] and rope part [rows, ROPE_PAD] from its q row pointer."""
    offs_lat = tl.arange(0, LATENT_PAD)
    offs_pe = tl.arange(0, ROPE_PAD)
    q_lat = tl.load(q_row[:, None] + offs_lat[None, :], mask=row_ok[:, None] & (offs_lat < LATENT_DIM)[None, :],
                    other=0.0)
    q_pe = tl.load(q_row[:, None] + LATENT_DIM + offs_pe[None, :],
                   mask=row_ok[:, None] & (offs_pe < ROPE_DIM)[None, :], other=0.0)
    if FP8_CACHE:  # fp16 dots: FP8 widens to fp16 in one instruction per pair, to bf16 it takes several
        q_lat = tl.clamp(q_lat.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_pe = tl.clamp(q_pe.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q_lat, q_pe


@triton.jit
def _latent_step(q_lat, q_pe, m, l, acc, entry, ok, visible, scale_log2, LATENT_DIM: tl.constexpr,
                 LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr, MASKED: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over the cache entries at `entry` [n] (pointers; `ok`: which to read, zeros
    elsewhere, not stale cache: 0 * nan is nan): scores q_lat . latent + q_pe . key_pe, hidden where not
    `visible` [rows, n] (MASKED), and the latents as the values."""
    offs_lat = tl.arange(0, LATENT_PAD)
    offs_pe = tl.arange(0, ROPE_PAD)
    latent = tl.load(entry[:, None] + offs_lat[None, :], mask=ok[:, None] & (offs_lat < LATENT_DIM)[None, :],
                     other=0.0).to(q_lat.dtype)
    key_pe = tl.load(entry[:, None] + LATENT_DIM + offs_pe[None, :], mask=ok[:, None] & (offs_pe < ROPE_DIM)[None, :],
                     other=0.0).to(q_lat.dtype)
    qk = (_dot(q_lat, tl.trans(latent), UPCAST, PRECISION) + _dot(q_pe, tl.trans(key_pe), UPCAST, PRECISION)) \
        * scale_log2
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    return _softmax_step(qk, latent, m, l, acc, UPCAST, PRECISION)


@triton.jit
def _attend_latent_tile(q_lat, q_pe, m, l, acc, start, hi, row_lim, table, cache_ptr, scale_log2, stride_cb,
                        stride_cs, LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr,
                        ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                        MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over context positions [start, start + TILE_N)."""
    pos = start + tl.arange(0, TILE_N)
    if MASKED:
        in_ctx = pos < hi
        blocks = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        in_ctx = pos >= 0
        blocks = tl.load(table + pos // BLOCK_SIZE)
    entry = cache_ptr + blocks.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    return _latent_step(q_lat, q_pe, m, l, acc, entry, in_ctx, pos[None, :] < row_lim[:, None], scale_log2,
                        LATENT_DIM, LATENT_PAD, ROPE_DIM, ROPE_PAD, MASKED, UPCAST, PRECISION)


@triton.jit(do_not_specialize=["num_reqs", "blocks_per_req", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "qsl_ptr"])
def _mla_attention_kernel(
        q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr,
        num_reqs, blocks_per_req, num_heads, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
        LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr, DIRECT: tl.constexpr, BLOCK_B: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr, FP8_CACHE: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_H
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    req, q_block = _locate(tl.program_id(0), qsl_ptr, num_reqs, blocks_per_req, DIRECT, BLOCK_Q, BLOCK_B)
    if req >= num_reqs:  # a surplus program (a Triton helper cannot end its caller: each exit stays here)
        return
    q_start, q_len, seq_len, first_q = _request_queries(req, q_block, qsl_ptr, seq_lens_ptr, BLOCK_Q)
    if (first_q >= q_len) | (seq_len <= 0):  # surplus q block or padding request: write nothing
        return
    q_idx, tokens, heads, row_ok = _query_rows(q_start, q_len, q_block, head_block, BLOCK_H, BLOCK_H, BLOCK_M)
    row_ok = row_ok & (heads < num_heads)
    q_lat, q_pe = _latent_query(q_ptr + tokens * stride_qt + heads * stride_qh, row_ok, LATENT_DIM, LATENT_PAD,
                                ROPE_DIM, ROPE_PAD, FP8_CACHE)

    if (NUM_SPLITS > 1) & (split * _split_tokens(seq_len, TILE_N, NUM_SPLITS, MIN_TILES) >= seq_len):
        return  # a split past a short context: the merge never reads it
    # Row i sees positions < prefix + i + 1.
    prefix, lo, hi, full_end = _context_span(seq_len, q_len, first_q, split, BLOCK_Q, TILE_N, NUM_SPLITS, MIN_TILES)
    row_lim = prefix + q_idx + 1

    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], tl.float32)
    for start in range(lo, full_end, TILE_N):
        m, l, acc = _attend_latent_tile(q_lat, q_pe, m, l, acc, start, hi, row_lim, table, cache_ptr, scale_log2,
                                        stride_cb, stride_cs, LATENT_DIM, LATENT_PAD, ROPE_DIM, ROPE_PAD,
                                        BLOCK_SIZE, TILE_N, False, UPCAST, PRECISION)
    for start in range(full_end, hi, TILE_N):
        m, l, acc = _attend_latent_tile(q_lat, q_pe, m, l, acc, start, hi, row_lim, table, cache_ptr, scale_log2,
                                        stride_cb, stride_cs, LATENT_DIM, LATENT_PAD, ROPE_DIM, ROPE_PAD,
                                        BLOCK_SIZE, TILE_N, True, UPCAST, PRECISION)

    offs_lat = tl.arange(0, LATENT_PAD)
    part = (tokens * num_heads + heads) * NUM_SPLITS + split  # the layout attention.py's merge kernel reads
    _write_rows(m, l, acc, out_ptr, tokens[:, None], heads[:, None], stride_ot, stride_oh, part, row_ok, offs_lat,
                offs_lat < LATENT_DIM, part_out_ptr, part_max_ptr, part_sum_ptr, LATENT_DIM, NUM_SPLITS)


@dataclass(frozen=True, slots=True)
class _Launch:
    block_h: int  # query heads per program
    block_m: int  # rows per program: BLOCK_Q tokens x block_h heads
    tile_n: int
    num_warps: int
    num_stages: int


def _launch_config(max_query_len: int, num_heads: int, latent_pad: int) -> _Launch:
    # The fp32 accumulator is rows x latent_pad: 16 rows of 512 already fill 4 warps' registers, so decodes
    # take 16 heads a program and prompt chunks 32 rows with 8 warps.
    block_h = min(16, triton.next_power_of_2(num_heads))
    rows = 16 if max_query_len == 1 else 32
    block_m = max(rows, block_h)
    wide = latent_pad >= 256
    return _Launch(block_h, block_m, tile_n=32 if wide else 64, num_warps=8 if block_m > 16 or wide else 4,
                   num_stages=2)


def _check_inputs(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, latent_dim: int, num_kv_splits: int,
                  max_query_len: int) -> None:
    if q.dim() != 3 or q.stride(-1) != 1 or q.shape[-1] <= latent_dim:
        raise ValueError(f"q must be [tokens, heads, latent_dim + rope_dim] with unit stride in the last dim, "
                         f"got {tuple(q.shape)} for latent_dim {latent_dim}")
    if out.shape != (*q.shape[:2], latent_dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be [tokens, heads, {latent_dim}] with unit stride in the last dim")
    if cache.dim() != 4 or cache.shape[2] != 1 or not cache.is_contiguous() or cache.shape[-1] < q.shape[-1]:
        raise ValueError("the latent cache must be a contiguous [blocks, block_size, 1, dim] tensor holding at "
                         "least q's last dim per token")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")
    if num_kv_splits > 1 and max_query_len > 1:
        raise ValueError("split-KV serves decode-only batches (max_query_len 1); pass num_kv_splits=1")


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor,
                  latent_dim: int, num_kv_splits: int = 1) -> torch.Tensor:
    """Causal absorbed MLA of each request's queries (the last q_len positions of its context); writes the
    `out` rows of real queries only and returns `out`.

    q: [T, H, latent_dim + rope_dim]; out: [T, H, latent_dim]; cache: [blocks, block_size, 1, dim >= q's]
    (q's dtype, or FP8 with a scale of 1) holding this step's entries already; block_tables int32 [B, max_blocks];
    seq_lens [B]; query_start_loc int32 [B + 1]; num_kv_splits > 1 only where max_query_len is 1.
    """
    _check_inputs(q, cache, out, latent_dim, num_kv_splits, max_query_len)
    num_tokens, num_heads, dim = q.shape
    rope_dim = dim - latent_dim
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return out
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    cfg = _launch_config(max_query_len, num_heads, latent_pad)
    blocks = query_blocks(num_tokens, num_reqs, max_query_len, cfg.block_m // cfg.block_h)
    partials = split_partials(out, num_kv_splits)
    _mla_attention_kernel[(blocks.programs, triton.cdiv(num_heads, cfg.block_h), num_kv_splits)](
        q, cache, out, block_tables, seq_lens, query_start_loc, *partials,
        num_reqs, blocks.per_request, num_heads, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        LATENT_DIM=latent_dim, LATENT_PAD=latent_pad, ROPE_DIM=rope_dim,
        ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_H=cfg.block_h, BLOCK_SIZE=cache.shape[1], BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        NUM_SPLITS=num_kv_splits, MIN_TILES=MIN_SPLIT_TILES, DIRECT=blocks.direct, BLOCK_B=blocks.block_b,
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_CACHE=cache.dtype.itemsize == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_kv_splits > 1:
        merge_splits(out, partials, num_reqs, seq_lens, query_start_loc, latent_pad, cfg.tile_n, num_kv_splits)
    return out


def mla_attention_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
                            latent_dim: int) -> torch.Tensor:
    """The same contract in plain torch, one masked fp32 softmax per request (slow; for tests)."""
    block_size, dim = cache.shape[1], q.shape[-1]
    loc, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = loc[b], loc[b + 1]
        if end == start or seq_len <= 0:
            continue
        blocks = block_tables[b, :-(-seq_len // block_size)].long()
        keys = cache[blocks].flatten(0, 1)[:seq_len, 0, :dim].float()  # [context, latent + rope]
        scores = torch.einsum("qhd,kd->hqk", q[start:end].float(), keys) * scale
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,kd->qhd", probs, keys[:, :latent_dim]).to(out.dtype)
    return out
