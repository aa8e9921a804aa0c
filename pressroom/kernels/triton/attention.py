"""Paged attention over a mixed batch (prefill chunks with a cached prefix, single-token decodes) in one launch,
with optional split-KV (flash-decoding).

Packing: one program serves BLOCK_Q query tokens of one request times the GROUP query heads that share a kv
head. They are the M rows of tl.dot (row = token * GROUP_PAD + head within the group), so a decode, one token,
still fills a tensor-core tile of M >= 16 rows. The program walks the request's context in tiles of TILE_N
tokens gathered through the block table (TILE_N need not equal the cache block size) with an online softmax
in fp32, in the exp2 domain. Tiles that every row sees in full skip the causal mask.

The launch depends on shapes and host ints only, never on values on the device, so a CUDA graph captured once
replays for any seq_lens and query lengths up to the max_query_len it was captured with:
grid = (q blocks, kv heads, splits) with q blocks = min(B * cdiv(max_query_len, BLOCK_Q), T // BLOCK_Q + B).
Under the first bound each request owns a fixed run of q blocks; under the second (smaller when few requests
are long) a program finds its request by a prefix sum over query_start_loc. Surplus programs exit at once.

Split-KV (decode-only batches: every query one token): each request's context is cut into at most
num_kv_splits contiguous runs of at least MIN_SPLIT_TILES tiles, computed in the kernel from seq_lens, so a
short context uses fewer splits than were launched (the surplus programs exit). Each split writes its
unnormalised partial max, sum and output to an fp32 workspace; a second kernel, one program per request
and query head, merges the splits in use in one vectorised pass.

Batch-invariant mode (`batch_invariant=True`): a query's reduction over its context must not depend on the
batch or on how its prompt was chunked. Every launch then takes the prompt chunks' tiles whatever the step's
max_query_len (one BLOCK_M, one TILE_N: the context is walked in TILE_N-token tiles from position 0 for every
query, decode or chunk), never splits the KV, masks every tile (which tiles could skip the mask depends on
the other queries of the program) and compiles without FMA contraction, so no code-shape difference can fuse
a multiply-add differently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting

_LOG2E = 1.4426950408889634
MIN_SPLIT_TILES = 2  # a split reads at least this many tiles: short contexts are not cut into slivers
INVARIANT_QUERY_LEN = 1 << 16  # batch-invariant launches are sized as for a query this long: the chunks' tiles
_INTERPRETED = interpreting()  # the same test triton.jit made when the kernels below were defined


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Triton 3.6's interpreter multiplies bf16 operands as raw 16-bit integers; fp32 copies give the same products.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _locate(pid, qsl_ptr, num_reqs, blocks_per_req, DIRECT: tl.constexpr, BLOCK_Q: tl.constexpr,
            BLOCK_B: tl.constexpr):
    """(request, q block within the request) served by program `pid`; request >= num_reqs for a surplus one."""
    if DIRECT:
        req = pid // blocks_per_req
        q_block = pid % blocks_per_req
    else:
        offs = tl.arange(0, BLOCK_B)
        valid = offs < num_reqs
        lens = tl.load(qsl_ptr + offs + 1, mask=valid, other=0) - tl.load(qsl_ptr + offs, mask=valid, other=0)
        blocks = (lens + BLOCK_Q - 1) // BLOCK_Q
        req = tl.sum((tl.cumsum(blocks, 0) <= pid).to(tl.int32), 0)
        q_block = pid - tl.sum(tl.where(offs < req, blocks, 0), 0)
    return req, q_block


@triton.jit
def _request_queries(req, q_block, qsl_ptr, seq_lens_ptr, BLOCK_Q: tl.constexpr):
    """Request `req`'s first query token, query count and context length, and the first query (within the
    request) of q block `q_block`."""
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    return q_start, q_len, seq_len, q_block * BLOCK_Q


@triton.jit
def _context_span(seq_len, q_len, first_q, split, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """What a q block's split walks: the queries are the last q_len positions of the context (prefix of them
    before), split `split` reads positions [lo, hi), and tiles before full_end are seen whole by every query of
    the block (no mask)."""
    prefix = seq_len - q_len
    block_end = tl.minimum(seq_len, prefix + first_q + BLOCK_Q)  # what the block's last query sees
    per_split = _split_tokens(seq_len, TILE_N, NUM_SPLITS, MIN_TILES)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, block_end)
    full_end = lo + tl.maximum(tl.minimum(prefix + first_q + 1, hi) - lo, 0) // TILE_N * TILE_N
    return prefix, lo, hi, full_end


@triton.jit
def _write_rows(m, l, acc, out_ptr, token_rows, head_rows, stride_ot, stride_oh, part, row_ok, offs_d, d_ok,
                part_out_ptr, part_max_ptr, part_sum_ptr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The rows' outputs, row r at out_ptr + token_rows[r] * stride_ot + head_rows[r] * stride_oh (both [rows, 1],
    or a scalar token); with splits, their partials (max, sum, unnormalised output) at index `part` [rows] of
    the [tokens, heads, splits] workspace instead."""
    io_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + token_rows * stride_ot + head_rows * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, l, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)


@triton.jit
def _query_rows(q_start, q_len, q_block, kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Per row of the tile: index of its query within the request, token, head, and whether it is real."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * (BLOCK_M // GROUP_PAD) + rows // GROUP_PAD
    g = rows % GROUP_PAD
    tokens = (q_start + q_idx).to(tl.int64)
    return q_idx, tokens, kv_head * GROUP + g, (q_idx < q_len) & (g < GROUP)


@triton.jit
def _attend_tile(q, m, l, acc, start, hi, row_lim, window, table, k_ptr, v_ptr, cache_off, d_ok, scale_log2,
                 stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                 SLIDING: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over context positions [start, start + TILE_N); SLIDING: a row sees positions
    [row_lim - window, row_lim) only."""
    pos = start + tl.arange(0, TILE_N)
    if MASKED:
        in_ctx = pos < hi
        blocks = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0)
        kv_mask = in_ctx[:, None] & d_ok[None, :]
    else:
        blocks = tl.load(table + pos // BLOCK_SIZE)
        kv_mask = d_ok[None, :]
    ptrs = (blocks.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None] + cache_off[None, :]
    # An FP8 cache is read at half the bytes and widened to q's type (fp16 then) for the dots (scale 1).
    k = tl.load(k_ptr + ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_ptr + ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # zeros, not stale cache (0 * nan is nan)
    qk = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2
    if MASKED:
        seen = pos[None, :] < row_lim[:, None]
        if SLIDING:
            seen = seen & (pos[None, :] >= row_lim[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
    return _softmax_step(qk, v, m, l, acc, UPCAST, PRECISION)


@triton.jit
def _softmax_step(qk, v, m, l, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax in the exp2 domain: fold scores qk [rows, n] (log2 units, -inf where hidden) and their
    values v [n, d] into the running max m, sum l and output acc."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return m_new, l, acc


# Runtime values Triton would otherwise specialise on, each new combination compiled anew mid-serving (a
# stall of seconds for every stream; a profile of the served H200 benchmark found a third of the core's
# time compiling): ints (== 1, divisible by 16), among them the block tables' row stride (the step's
# widest table, which grows with the contexts), and the 16-byte alignment of the per-request arrays,
# which a mixed step's prompt-chunk launch passes from the first chunk's row on (after the decodes).
@triton.jit(do_not_specialize=["num_reqs", "blocks_per_req", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "qsl_ptr"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
        num_reqs, blocks_per_req, scale_log2, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        MIN_TILES: tl.constexpr, DIRECT: tl.constexpr, BLOCK_B: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr, FP8_CACHE: tl.constexpr, ALL_MASKED: tl.constexpr, SLIDING: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, q_block = _locate(tl.program_id(0), qsl_ptr, num_reqs, blocks_per_req, DIRECT, BLOCK_Q, BLOCK_B)
    if req >= num_reqs:  # a surplus program (a Triton helper cannot end its caller: each exit stays here)
        return
    q_start, q_len, seq_len, first_q = _request_queries(req, q_block, qsl_ptr, seq_lens_ptr, BLOCK_Q)
    if (first_q >= q_len) | (seq_len <= 0):  # surplus q block or padding request: write nothing
        return
    q_idx, tokens, heads, row_ok = _query_rows(q_start, q_len, q_block, kv_head, GROUP, GROUP_PAD, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if FP8_CACHE:  # fp16 dots: FP8 widens to fp16 in one instruction per pair, to bf16 it takes several
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    if (NUM_SPLITS > 1) & (split * _split_tokens(seq_len, TILE_N, NUM_SPLITS, MIN_TILES) >= seq_len):
        return  # a split past a short context: the merge never reads it
    # Row i sees positions < prefix + i + 1.
    prefix, lo, hi, full_end = _context_span(seq_len, q_len, first_q, split, BLOCK_Q, TILE_N, NUM_SPLITS, MIN_TILES)
    if ALL_MASKED:  # which tiles skip the mask depends on the tile's first query: one code path for all
        full_end = lo
    if SLIDING:  # start at the tile holding the first key any row sees; every tile masked (a window's edge moves
        # with the row, so a tile can be cut for some rows and not others)
        lo = tl.maximum(lo, tl.maximum(prefix + first_q + 1 - window, 0) // TILE_N * TILE_N)
        full_end = lo
    row_lim = prefix + q_idx + 1  # hi needs no say: it never cuts between a real row and what it sees

    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    cache_off = kv_head * stride_ch + offs_d
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row with nothing visible yet never does inf - inf
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, full_end, TILE_N):
        m, l, acc = _attend_tile(q, m, l, acc, start, hi, row_lim, window, table, k_ptr, v_ptr, cache_off, d_ok,
                                 scale_log2, stride_cb, stride_cs, BLOCK_SIZE, TILE_N, False, False, UPCAST,
                                 PRECISION)
    for start in range(full_end, hi, TILE_N):
        m, l, acc = _attend_tile(q, m, l, acc, start, hi, row_lim, window, table, k_ptr, v_ptr, cache_off, d_ok,
                                 scale_log2, stride_cb, stride_cs, BLOCK_SIZE, TILE_N, True, SLIDING, UPCAST,
                                 PRECISION)

    if HAS_SINKS and NUM_SPLITS == 1:  # the sink joins the denominator (its value is zero); with splits, the
        # merge adds it once
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    part = (tokens * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
    _write_rows(m, l, acc, out_ptr, tokens[:, None], heads[:, None], stride_ot, stride_oh, part, row_ok, offs_d, d_ok,
                part_out_ptr, part_max_ptr, part_sum_ptr, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _split_tokens(seq_len, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """Context tokens per split; the splits in use are cdiv(seq_len, this)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SPLITS), MIN_TILES) * TILE_N


@triton.jit
def _merge_splits_kernel(
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, qsl_ptr, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr, MIN_TILES: tl.constexpr, MERGE_CHUNK: tl.constexpr,
        HAS_SINKS: tl.constexpr = False, sinks_ptr=None):
    """One program per (request, query head) of a decode batch: out = sum_s w_s * acc_s / sum_s w_s * l_s (plus
    the head's sink in the denominator)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(qsl_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    if (tl.load(qsl_ptr + req + 1) <= token) | (seq_len <= 0):  # padding request: nothing to write
        return
    in_use = tl.cdiv(seq_len, _split_tokens(seq_len, TILE_N, NUM_SPLITS, MIN_TILES))
    row = (token.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    m = tl.load(part_max_ptr + row + splits, mask=splits < in_use, other=-1.0e30)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m_max = tl.maximum(m_max, sink)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    l = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((D_PAD,), dtype=tl.float32)
    # MERGE_CHUNK splits at a time: a [splits, D] tile of all of them (64 x MLA's 512) would not fit registers
    for first in range(0, SPLITS_PAD, MERGE_CHUNK):
        chunk = first + tl.arange(0, MERGE_CHUNK)
        used = chunk < in_use
        w = tl.where(used, tl.exp2(tl.load(part_max_ptr + row + chunk, mask=used, other=-1.0e30) - m_max), 0.0)
        l += tl.sum(w * tl.load(part_sum_ptr + row + chunk, mask=used, other=0.0), 0)
        part = tl.load(part_out_ptr + (row + chunk)[:, None] * HEAD_DIM + offs_d[None, :],
                       mask=used[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    if HAS_SINKS:
        l += tl.exp2(sink - m_max)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@dataclass(frozen=True, slots=True)
class _Launch:
    block_m: int  # query rows per program: BLOCK_Q tokens x GROUP_PAD heads
    tile_n: int  # context tokens per step
    num_warps: int
    num_stages: int


def _launch_config(max_query_len: int, group_pad: int, d_pad: int) -> _Launch:
    # Decodes (and short speculative queries) need only M = 16 rows; longer chunks take 64 rows per program,
    # enough to keep Hopper's tensor cores busy while many programs still share a mixed batch. Tiles and
    # stages from benchmarks/gpu/attention_sweep.py on the H200 (Llama-3.1-8B heads): decodes read 64-token
    # tiles at ~4.1-4.3 TB/s; prompt chunks run ~20% faster on 32-token tiles than on 64.
    block_m = max(16, group_pad, min(group_pad * triton.next_power_of_2(max_query_len), 64))
    tile_n = 32 if block_m >= 64 or d_pad > 128 else 64
    return _Launch(block_m, tile_n, num_warps=4 if block_m <= 64 else 8, num_stages=2)


@dataclass(frozen=True, slots=True)
class QueryBlocks:
    """How a launch spreads the requests' q blocks (block_q query tokens each) over its programs: `direct`,
    each request owns a fixed run of `per_request` blocks; otherwise a program finds its request by a prefix
    sum over up to `block_b` requests."""
    per_request: int
    direct: bool
    programs: int
    block_b: int


def query_blocks(num_tokens: int, num_reqs: int, max_query_len: int, block_q: int) -> QueryBlocks:
    per_request = triton.cdiv(max_query_len, block_q)
    direct = num_reqs * per_request <= num_tokens // block_q + num_reqs
    programs = num_reqs * per_request if direct else num_tokens // block_q + num_reqs
    block_b = 1 if direct else max(64, triton.next_power_of_2(num_reqs))  # few variants to compile
    return QueryBlocks(per_request, direct, programs, block_b)


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split launch's fp32 workspace for out [T, H, D]: unnormalised outputs [T, H, splits, D], running maxima
    and sums [T, H, splits]. Without splits the kernels write `out` directly and never touch these: `out` stands
    in for all three."""
    if num_splits == 1:
        return out, out, out
    tokens, heads, dim = out.shape
    part_out = torch.empty(tokens, heads, num_splits, dim, dtype=torch.float32, device=out.device)
    part_max = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


def merge_splits(out: torch.Tensor, partials: tuple[torch.Tensor, ...], num_reqs: int, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, d_pad: int, tile_n: int, num_splits: int,
                 sinks_log2: torch.Tensor | None = None) -> None:
    """Writes the decode output of each of the first num_reqs requests into `out` [T, H, D] from its splits'
    partials (split_partials); sinks_log2 [H]: each head's sink in the denominator, in log2 units."""
    splits_pad = triton.next_power_of_2(num_splits)
    _merge_splits_kernel[(num_reqs, out.shape[1])](
        out, *partials, seq_lens, query_start_loc, out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2], D_PAD=d_pad, TILE_N=tile_n, NUM_SPLITS=num_splits,
        SPLITS_PAD=splits_pad, MIN_TILES=MIN_SPLIT_TILES, MERGE_CHUNK=min(splits_pad, 16),
        HAS_SINKS=sinks_log2 is not None,
        sinks_ptr=sinks_log2, num_warps=4)


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, num_kv_splits: int,
                  max_query_len: int) -> None:
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [tokens, heads, head_dim] with unit stride in head_dim, got {tuple(q.shape)}")
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and unit stride in head_dim")
    if kv_cache.dim() != 5 or not kv_cache.is_contiguous() or kv_cache.shape[-1] != q.shape[-1]:
        raise ValueError("kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor "
                         "with q's head_dim")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {kv_cache.shape[3]} kv heads")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")
    if num_kv_splits > 1 and max_query_len > 1:
        raise ValueError("split-KV serves decode-only batches (max_query_len 1); pass num_kv_splits=1")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor,
                    num_kv_splits: int = 1, batch_invariant: bool = False, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's queries (the last q_len positions of its context) over its paged
    context; writes `out` rows of real queries only and returns `out`.

    q, out: [T, H, D]; kv_cache: [2, blocks, block_size, kv_heads, D] holding this step's k, v already
    (q's dtype, or FP8 with a scale of 1);
    block_tables: int32 [B, max_blocks]; seq_lens: [B] context lengths including this step's tokens;
    query_start_loc: int32 [B + 1]; max_query_len: at least every request's query length; num_kv_splits > 1
    only where max_query_len is 1; batch_invariant: each query computed the same way in any batch (see the
    module's docstring; num_kv_splits must be 1); window: a query at position p sees keys p - window + 1 .. p
    only; sinks [H] (gpt-oss): one more logit per head in each softmax's denominator, with no value.
    """
    if batch_invariant and num_kv_splits != 1:
        raise ValueError("batch-invariant attention never splits the KV; pass num_kv_splits=1")
    _check_inputs(q, kv_cache, out, num_kv_splits, max_query_len)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad, d_pad = triton.next_power_of_2(group), max(16, triton.next_power_of_2(head_dim))
    cfg = _launch_config(INVARIANT_QUERY_LEN if batch_invariant else max_query_len, group_pad, d_pad)
    blocks = query_blocks(num_tokens, num_reqs, max_query_len, cfg.block_m // group_pad)
    partials = split_partials(out, num_kv_splits)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    sinks_log2 = None if sinks is None else (sinks.float() * _LOG2E).contiguous()  # the kernels' exp2 domain
    _paged_attention_kernel[(blocks.programs, num_kv_heads, num_kv_splits)](
        q, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        *partials, out if sinks_log2 is None else sinks_log2,  # out: a placeholder, never read
        num_reqs, blocks.per_request, scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, NUM_SPLITS=num_kv_splits, MIN_TILES=MIN_SPLIT_TILES,
        DIRECT=blocks.direct, BLOCK_B=blocks.block_b,
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_CACHE=kv_cache.dtype.itemsize == 1,
        ALL_MASKED=batch_invariant, SLIDING=window is not None, HAS_SINKS=sinks is not None,
        enable_fp_fusion=not batch_invariant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_kv_splits > 1:
        merge_splits(out, partials, num_reqs, seq_lens, query_start_loc, d_pad, cfg.tile_n, num_kv_splits, sinks_log2)
    return out


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                              out: torch.Tensor, window: int | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract in plain torch: one masked fp32 softmax per request (slow; for tests)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    loc, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = loc[b], loc[b + 1]
        if end == start or seq_len <= 0:
            continue
        blocks = block_tables[b, :-(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos[:, None]
        if window is not None:
            visible &= key_pos > query_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # a column per head that takes its share of the softmax and is dropped
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
