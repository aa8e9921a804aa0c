"""DeepSeek-V4's attention on the GPU: each query's one softmax over its sliding window's K=V vectors, its
compressed entries (HCA: every causal one; CSA: those its lightning indexer chose) and its head's sink; the
indexer's choice of entries, built for the whole step on the device; and the compressor's mixing of the windows
that decodes close.

Caches (model/models/deepseek_v4.py). The window's K=V: a ring per request [slots, rows, head_dim] (position p at
row p % rows) holding the positions before the step, the step's own K=V [tokens, head_dim] from a request's first
query on; or (the MTP drafter's layer) a latent paged cache [1, blocks, block_size, 1, head_dim]: position p at
block table[p // block_size], offset p % block_size. A compressed cache
(model/layers/compressed_kv.py) is [1, blocks, entries_per_block, 1, entry_dim]; entry w lives in the block of
token w * rate + rate - 1. `entry_table` turns that into a table of entries: entry w at entry_table[w // E],
offset w % E (E entries per block; where a window spans several blocks, E = 1 and the table is every
(rate / block_size)-th column of the block table). The keys are the values (MQA, one KV head); a CSA entry carries
the indexer's key after its head_dim values.

`mix_closing_windows`: the compressor's step for decodes, whose projections are in their rings already: the
programs of decodes that close a window mix its entry, the others exit at once (only the normalisation and the
rope of the entries are left to torch).

The sink joins the softmax as a logit with no value: the first split of each query starts from (max = sink,
sum = 1, acc = 0), the others from nothing, so dsa.py's token-split merge gives the whole softmax. Every launch
reads only device tensors, with grids fixed by the step's padded shapes, so decode steps are captured into CUDA
graphs; queries are addressed by (request, position) from `dsa.token_positions` (padding rows: position -1, which
reads nothing and gets zeros).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting
from pressroom.kernels.triton.attention import _LOG2E, _dot, _softmax_step, _write_rows, split_partials
from pressroom.kernels.triton.dsa import _merge_token_splits_kernel, choose_positions

_INTERPRETED = interpreting()
SLIDING_ONLY, ALL_CAUSAL, CHOSEN = 0, 1, 2  # which compressed entries a query reads (the kernel's MODE)


def entry_table(block_tables: torch.Tensor, rate: int, block_size: int) -> tuple[torch.Tensor, int]:
    """(table of entries [B, cols] (contiguous int32/int64), entries per block): entry w of request b lives in
    block table[b, w // E] at offset w % E."""
    if block_size % rate == 0:
        return block_tables, block_size // rate
    span = rate // block_size  # blocks per window: the entry sits in the window's last block
    return block_tables[:, span - 1::span].contiguous(), 1


@triton.jit
def _keys_step(q, m, l, acc, rows, ok, d, d_ok, scale_log2, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (= values) at row pointers `rows` [TILE_N] (`ok`: real): the online softmax advanced. The
    keys in q's type (an FP8 cache holds them unscaled)."""
    k = tl.load(rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2  # [BLOCK_H, TILE_N]
    return _softmax_step(tl.where(ok[None, :], s, float("-inf")), k, m, l, acc, UPCAST, PRECISION)


@triton.jit
def _v4_attention_kernel(q_ptr, window_ptr, entries_ptr, out_ptr, block_tables_ptr, entry_tables_ptr,
                         token_req_ptr, token_pos_ptr, chosen_ptr, sinks_ptr, part_out_ptr, part_max_ptr,
                         part_sum_ptr, ring_ptr, slots_ptr, starts_ptr, kv_ptr, ring_rows, num_heads, window, rate,
                         num_cols, per_split, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_wb,
                         stride_ws, stride_eb, stride_es, stride_bt, stride_et, stride_ct, stride_rs, stride_rr,
                         stride_kt, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, ENTRIES_PER_BLOCK: tl.constexpr, WINDOW_PAD: tl.constexpr,
                         TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr, RING: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One query, BLOCK_H heads, one split of its keys: columns 0 .. WINDOW_PAD - 1 are the window's positions
    pos - window + 1 + j (RING: those before the request's first token of the step from its ring, the rest from
    the step's own K=V; else from the paged cache), the rest its compressed entries (CHOSEN: their indices in
    chosen's row)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    req = tl.load(token_req_ptr + token)
    pos = tl.load(token_pos_ptr + token)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    first = split == 0  # the sink: a logit with no value, counted once
    m = tl.where(first, sink, -1.0e30)
    l = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    lo = split * per_split
    hi = lo + per_split
    table = block_tables_ptr + req * stride_bt
    if RING:
        ring = ring_ptr + tl.load(slots_ptr + req).to(tl.int64) * stride_rs
        step_first = tl.load(token_pos_ptr + tl.load(starts_ptr + req))  # the request's first position this step
    for start in range(lo, tl.minimum(hi, WINDOW_PAD), TILE_N):
        j = start + tl.arange(0, TILE_N)
        key_pos = pos - window + 1 + j
        ok = (key_pos >= 0) & (key_pos <= pos)  # j < window: key_pos <= pos
        if RING:
            safe = tl.where(ok, key_pos, 0)
            rows = tl.where(safe >= step_first, kv_ptr + (token - (pos - safe)) * stride_kt,
                            ring + (safe % ring_rows) * stride_rr)
        else:
            blocks = tl.load(table + key_pos // BLOCK_SIZE, mask=ok, other=0)
            rows = window_ptr + blocks.to(tl.int64) * stride_wb + (key_pos % BLOCK_SIZE) * stride_ws
        m, l, acc = _keys_step(q, m, l, acc, rows, ok, d, d_ok, scale_log2, UPCAST, PRECISION)
    if MODE != 0:
        count = tl.minimum((pos + 1) // rate, num_cols)  # a query's causal entries (CHOSEN: its chosen ones first)
        entry_table = entry_tables_ptr + req * stride_et
        for start in range(tl.maximum(lo, WINDOW_PAD), tl.minimum(hi, WINDOW_PAD + count), TILE_N):
            col = start - WINDOW_PAD + tl.arange(0, TILE_N)
            ok = col < count
            if MODE == 2:
                entry = tl.load(chosen_ptr + token * stride_ct + col, mask=ok, other=-1)
                ok = ok & (entry >= 0)
            else:
                entry = col
            blocks = tl.load(entry_table + entry // ENTRIES_PER_BLOCK, mask=ok, other=0)
            rows = entries_ptr + blocks.to(tl.int64) * stride_eb + (entry % ENTRIES_PER_BLOCK) * stride_es
            m, l, acc = _keys_step(q, m, l, acc, rows, ok, d, d_ok, scale_log2, UPCAST, PRECISION)
    part = (token * num_heads + heads) * NUM_SPLITS + split
    _write_rows(m, l, acc, out_ptr, token, heads[:, None], stride_ot, stride_oh, part, h_ok, d, d_ok,
                part_out_ptr, part_max_ptr, part_sum_ptr, HEAD_DIM, NUM_SPLITS)


# Splits of a query's keys: until a launch reaches about this many programs (two per SM of an H200), each split
# reading at least two tiles.
_TARGET_PROGRAMS = 2 * 132
_MAX_SPLITS = 16


def key_splits(tokens: int, head_blocks: int, tiles: int) -> int:
    wanted = -(-_TARGET_PROGRAMS // max(1, tokens * head_blocks))
    return max(1, min(wanted, _MAX_SPLITS, tiles // 2))


def v4_attention(q: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor, sinks: torch.Tensor, window: int,
                 scale: float, paged: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 entries: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
                 chosen: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q [T, H, D] at (token_req, token_pos) (dsa.token_positions) over its window, read from one of:
    `paged` = (window cache [1, blocks, block_size, 1, D], block tables [B, blocks]); `ring` = (rings [slots,
    rows, D] holding position p at row p % rows, each request's slot [B], the query starts [B + 1], the step's
    own K=V [T, D]: a request's positions from its first of the step on are read there). With `entries` =
    (compressed cache [1, blocks, E, 1, >= D], entry table, E, rate) from `entry_table`, also its causal
    compressed entries, or with `chosen` [T, k] only those: a query reads its first min(k, causal entries) columns
    (-1 there: skipped), where `choose_entries` puts its causal ones (what follows, entries it cannot see, is not
    read: dsa.py's rule); sinks [H] (fp32). Returns [T, H, D] in q's dtype."""
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    if (paged is None) == (ring is None):
        raise ValueError("V4 attention reads its window from one source: pass `paged` or `ring`")
    if ring is not None:
        rings, slots, starts, kv = ring
        cache, block_tables = rings, token_pos  # (unread in ring mode)
        ring_args = (rings, slots, starts, kv, rings.shape[1])
        ring_strides = (rings.stride(0), rings.stride(1), kv.stride(0))
    else:
        cache, block_tables = paged[0][0], paged[1]
        ring_args, ring_strides = (cache, token_req, token_req, q, 1), (0, 0, 0)
    if q.stride(-1) != 1 or cache.shape[-1] != dim:
        raise ValueError(f"V4 attention needs q [tokens, heads, {cache.shape[-1]}] with unit last stride; "
                         f"got {tuple(q.shape)}")
    mode, cols = SLIDING_ONLY, 0
    table, per_block, rate, ent = block_tables, 1, 1, cache
    if entries is not None:
        ent_cache, table, per_block, rate = entries
        ent = ent_cache[0]
        mode, cols = (CHOSEN, chosen.shape[1]) if chosen is not None else (ALL_CAUSAL, table.shape[1] * per_block)
    chosen = chosen if chosen is not None else token_pos
    d_pad = max(16, triton.next_power_of_2(dim))
    tile = 32 if d_pad >= 256 else 64
    block_h = 16
    window_pad = triton.cdiv(window, tile) * tile
    head_blocks = triton.cdiv(heads, block_h)
    tiles = triton.cdiv(window_pad + cols, tile)
    splits = num_splits or key_splits(tokens, head_blocks, tiles)
    per_split = triton.cdiv(tiles, splits) * tile
    partials = split_partials(out, splits)
    _v4_attention_kernel[(tokens, head_blocks, splits)](
        q, cache, ent, out, block_tables, table, token_req, token_pos, chosen, sinks, *partials, *ring_args, heads,
        window, rate, cols, per_split, scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), ent.stride(0), ent.stride(1), block_tables.stride(0), table.stride(0),
        chosen.stride(0), *ring_strides, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_H=block_h,
        BLOCK_SIZE=cache.shape[1] if ring is None else 1, ENTRIES_PER_BLOCK=per_block, WINDOW_PAD=window_pad,
        TILE_N=tile, NUM_SPLITS=splits, MODE=mode, RING=ring is not None,
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if d_pad >= 256 else 4, num_stages=2)
    if splits > 1:
        _merge_token_splits_kernel[(tokens, heads)](
            out, *partials, heads, out.stride(0), out.stride(1), LATENT_DIM=dim, LATENT_PAD=d_pad,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)
    return out


def choose_entries(index_q: torch.Tensor, index_w: torch.Tensor, entries: tuple[torch.Tensor, torch.Tensor, int, int],
                   token_req: torch.Tensor, token_pos: torch.Tensor, index_offset: int, top_k: int) -> torch.Tensor:
    """The lightning indexer's choice: each query's `top_k` best causal entries [T, min(top_k, entries)] (best
    first; where it has fewer, entries past its last causal one: unused, dsa.py's rule), from its queries index_q
    [T, heads, dim] and head weights index_w [T, heads] (fp32) and the indexer keys at `index_offset` of each entry
    of `entries` (as `v4_attention` takes them)."""
    cache, table, _, rate = entries
    last = torch.div(token_pos + 1, rate, rounding_mode="floor") - 1  # the last entry a query sees (-1: none)
    return choose_positions(index_q, index_w, cache[0], table, token_req, last, index_offset, top_k)


@triton.jit
def _window_series(kv_ptr, gate_ptr, bias_ptr, row0, col0, cols, c_ok, stride_r, stride_br, M: tl.constexpr,
                   M_PAD: tl.constexpr):
    """One window's m ring rows from row0 at columns col0 + cols: kv and biased gate [M_PAD, BLOCK_D] (fp32;
    rows past M: gate -inf; columns past the features: 0)."""
    i = tl.arange(0, M_PAD)
    ok = (i < M)[:, None] & c_ok[None, :]
    offs = (row0 + i)[:, None] * stride_r + col0 + cols[None, :]
    kv = tl.load(kv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    gate += tl.load(bias_ptr + i[:, None] * stride_br + col0 + cols[None, :], mask=ok, other=0.0)
    return kv, tl.where((i < M)[:, None], gate, float("-inf"))


@triton.jit
def _mix_closing_kernel(kv_ring_ptr, gate_ring_ptr, bias_ptr, slots_ptr, pos_ptr, targets_ptr, out_ptr, dim,
                        stride_slot, stride_r, stride_br, stride_o, M: tl.constexpr, M_PAD: tl.constexpr,
                        RING: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_D: tl.constexpr):
    """One decode, BLOCK_D features: where its token closes a window (target >= 0), the gated softmax mix of the
    window's ring rows per feature (OVERLAP: window w - 1's first-half features beside window w's second-half
    ones); zeros elsewhere."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = cols < dim
    mixed = tl.zeros([BLOCK_D], tl.float32)
    if tl.load(targets_ptr + token) >= 0:
        pos = tl.load(pos_ptr + token)
        window = pos // M
        ring = tl.load(slots_ptr + token).to(tl.int64) * stride_slot
        kv_ptr, gate_ptr = kv_ring_ptr + ring, gate_ring_ptr + ring
        kv, gate = _window_series(kv_ptr, gate_ptr, bias_ptr, window * M % RING, dim if OVERLAP else 0, cols, c_ok,
                                  stride_r, stride_br, M, M_PAD)
        top = tl.max(gate, 0)
        if OVERLAP:  # window w - 1's rows (none before window 0)
            prev = (window * M + RING - M) % RING
            kv_a, gate_a = _window_series(kv_ptr, gate_ptr, bias_ptr, prev, 0, cols, c_ok, stride_r, stride_br, M,
                                          M_PAD)
            gate_a = tl.where(window > 0, gate_a, float("-inf"))
            top = tl.maximum(top, tl.max(gate_a, 0))
        weights = tl.exp(gate - top[None, :])
        total = tl.sum(weights, 0)
        mixed = tl.sum(weights * kv, 0)
        if OVERLAP:
            weights_a = tl.exp(gate_a - top[None, :])
            total += tl.sum(weights_a, 0)
            mixed += tl.sum(weights_a * kv_a, 0)
        mixed = mixed / tl.where(c_ok, total, 1.0)
    tl.store(out_ptr + token * stride_o + cols, mixed, mask=c_ok)


def mix_closing_windows(kv_ring: torch.Tensor, gate_ring: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor, targets: torch.Tensor, dim: int, overlap: bool) -> torch.Tensor:
    """DeepSeek-V4's compressor for decodes whose projections are in their rings already: kv_ring, gate_ring
    [slots, ring, width] (width = dim, or 2 * dim with `overlap`: CSA), bias [rate, width] (fp32); slots,
    positions, targets [n] (target < 0: the token closes no window, or is padding). Returns [n, dim] fp32: the
    mixed (not yet normalised or rotated) entry of each closed window, zeros for the others."""
    n, rate = positions.shape[0], bias.shape[0]
    out = torch.empty(n, dim, dtype=torch.float32, device=positions.device)
    if n == 0:
        return out
    m_pad = max(16, triton.next_power_of_2(rate))
    block_d = max(16, min(128, 4096 // m_pad))  # [m_pad, block_d] tiles of kv and gate in registers
    _mix_closing_kernel[(n, triton.cdiv(dim, block_d))](
        kv_ring, gate_ring, bias, slots, positions, targets, out, dim, kv_ring.stride(0), kv_ring.stride(1),
        bias.stride(0), out.stride(0), M=rate, M_PAD=m_pad, RING=kv_ring.shape[1],
        OVERLAP=overlap, BLOCK_D=block_d, num_warps=4)
    return out
