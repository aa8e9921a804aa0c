"""DeepSeek Sparse Attention on the GPU: the lightning indexer's scores over a paged cache, and MLA that reads
only the tokens each query selected.

Each cache entry holds the latent, the rotated shared key, then the indexer's key (`index_dim` values at
`index_offset`). The indexer score of a past token for one query is sum_h w_h * relu(q_h . k * dim^-0.5)
(the checkpoints' order: scale, relu, then the weighted sum), -inf where the token is not yet visible; the
caller takes the top-k per query and passes the chosen positions to `sparse_mla_attention`, whose cost grows
with k, not with the context. Both launches read only device tensors and shapes, so they are captured into CUDA
graphs.

Which chosen positions are used (the one rule, for the kernels and their references): position p of a query at
position `token_pos` (`token_positions`; -1 on padding rows) is read iff 0 <= p <= token_pos. So `select_top_k`
returns topk's indices as they are, with no pass that marks the unused ones (a compare, a fill and a where: three
launches a layer). Why that is exact: `indexer_logits` writes -inf exactly at p > token_pos (its `visible` mask;
a whole tile past token_pos is -inf unread) and a finite score at every p <= token_pos (a weighted sum of relus
of finite inputs), so where a query sees fewer than k positions, topk takes every visible one (finite beats -inf,
however it breaks the ties among the -infs) and fills the rest with positions of -inf scores, each past
token_pos; a padding row scores nothing and reads nothing. -1 (hand-made choices) is unused as well. V4's
`choose_entries` applies it to compressed entries (token_pos: a query's last causal entry).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting
from pressroom.kernels.triton.attention import _LOG2E, _write_rows, split_partials
from pressroom.kernels.triton.mla import _latent_query, _latent_step

_INTERPRETED = interpreting()


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's request and position in its context (a request's queries are its last positions);
    tokens past the last request's (padding rows) get request 0 and position -1. No host sync."""
    t = torch.arange(num_tokens, device=seq_lens.device)
    ends = query_start_loc[1:].long()
    req = torch.searchsorted(ends, t, right=True).clamp(max=ends.numel() - 1)
    pos = seq_lens.long()[req] - (ends[req] - t)
    real = t < ends[-1]
    return torch.where(real, req, 0), torch.where(real, pos, -1)


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr, cache_ptr, block_tables_ptr, token_req_ptr, token_pos_ptr, out_ptr,
                           num_heads, width, index_offset, scale, weight_scale, stride_qt, stride_qh, stride_wt,
                           stride_cb, stride_cs, stride_bt, stride_ot, INDEX_DIM: tl.constexpr, D_PAD: tl.constexpr,
                           H_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                           BF16_DOTS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    last = tl.load(token_pos_ptr + token)
    visible = (pos <= last) & (pos < width)
    logits = tl.full([TILE_N], float("-inf"), tl.float32)
    if tl.program_id(1) * TILE_N <= last:
        req = tl.load(token_req_ptr + token)
        heads = tl.arange(0, H_PAD)
        dims = tl.arange(0, D_PAD)
        h_ok = heads < num_heads
        d_ok = dims < INDEX_DIM
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + token * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32) * weight_scale
        blocks = tl.load(block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=visible, other=0)
        entry = cache_ptr + blocks.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + index_offset
        k = tl.load(entry[:, None] + dims[None, :], mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if BF16_DOTS:  # tensor cores for a bf16 / fp16 / FP8 cache; an fp32 model keeps exact fp32 products
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        scores = tl.maximum(dots * scale, 0.0)  # [heads, TILE_N]
        logits = tl.where(visible, tl.sum(w[:, None] * scores, 0), float("-inf"))
    tl.store(out_ptr + token * stride_ot + pos, logits, mask=pos < width)


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   token_req: torch.Tensor, token_pos: torch.Tensor, index_offset: int,
                   weight_scale: float = 1.0) -> torch.Tensor:
    """q [T, index_heads, index_dim] and weights [T, index_heads] (any float dtype: read into fp32, the weights then
    times `weight_scale`, as `weights.float() * weight_scale` would make them, without its launches); cache [blocks,
    block_size, 1, entry]; block_tables [B, max_blocks]. Returns fp32 [T, max_blocks * block_size]: each query's
    score of every position of its request's context, -inf past its own position."""
    tokens, heads, dim = q.shape
    block_size = cache.shape[1]
    width = block_tables.shape[1] * block_size
    out = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out
    tile = 64
    _indexer_logits_kernel[(tokens, triton.cdiv(width, tile))](
        q, weights, cache, block_tables, token_req, token_pos, out, heads, width, index_offset, dim ** -0.5,
        weight_scale, q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1),
        block_tables.stride(0), out.stride(0), INDEX_DIM=dim, D_PAD=max(16, triton.next_power_of_2(dim)),
        H_PAD=max(16, triton.next_power_of_2(heads)), BLOCK_SIZE=block_size, TILE_N=tile,
        BF16_DOTS=cache.dtype != torch.float32 and not _INTERPRETED, num_warps=4)
    return out


# A prompt step scores every query against the widest context of the step: its fp32 scores are made this many
# bytes at a time (16k prompt tokens over a 128k-token table would take 8 GiB at once).
SCORE_BYTES = 512 << 20


def choose_positions(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     token_req: torch.Tensor, token_pos: torch.Tensor, index_offset: int, top_k: int,
                     weight_scale: float = 1.0) -> torch.Tensor:
    """Each query's `top_k` best positions [T, k] (`select_top_k`'s), its scores (`indexer_logits`) made and reduced
    in runs of queries whose scores fit SCORE_BYTES; a step of one run (any decode step) is chosen in place."""
    tokens = q.shape[0]
    width = block_tables.shape[1] * cache.shape[1]
    run = max(1, SCORE_BYTES // (4 * width))
    if tokens <= run:
        return select_top_k(indexer_logits(q, weights, cache, block_tables, token_req, token_pos, index_offset,
                                           weight_scale), top_k)
    chosen = torch.empty(tokens, min(top_k, width), dtype=torch.int64, device=q.device)
    for start in range(0, tokens, run):
        end = min(tokens, start + run)
        logits = indexer_logits(q[start:end], weights[start:end], cache, block_tables, token_req[start:end],
                                token_pos[start:end], index_offset, weight_scale)
        chosen[start:end] = select_top_k(logits, top_k)
    return chosen


def select_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The `top_k` best positions per query [T, k] (k = min(top_k, width)), best first; where fewer are visible, the
    rest are invisible positions (past the query's own: unused, the module's rule)."""
    return logits.topk(min(top_k, logits.shape[1]), dim=-1).indices


@triton.jit
def _sparse_mla_kernel(q_ptr, cache_ptr, out_ptr, block_tables_ptr, token_req_ptr, token_pos_ptr, chosen_ptr,
                       part_out_ptr, part_max_ptr, part_sum_ptr, num_heads, top_k, per_split,
                       scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
                       stride_ct, LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr,
                       ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
                       PRECISION: tl.constexpr, FP8_CACHE: tl.constexpr):
    """One token, BLOCK_H heads, one run of `per_split` of its chosen positions (all of them without splits)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    req = tl.load(token_req_ptr + token)
    last = tl.load(token_pos_ptr + token)  # chosen positions past it are unused (the module's rule)
    q_lat, q_pe = _latent_query(q_ptr + token * stride_qt + heads * stride_qh, h_ok, LATENT_DIM, LATENT_PAD,
                                ROPE_DIM, ROPE_PAD, FP8_CACHE)
    table = block_tables_ptr + req * stride_bt
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, top_k)
    for start in range(lo, hi, TILE_N):
        j = start + tl.arange(0, TILE_N)
        pos = tl.load(chosen_ptr + token * stride_ct + j, mask=j < hi, other=-1)
        ok = (pos >= 0) & (pos <= last)
        blocks = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
        entry = cache_ptr + blocks.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        m, l, acc = _latent_step(q_lat, q_pe, m, l, acc, entry, ok, ok[None, :], scale_log2, LATENT_DIM, LATENT_PAD,
                                 ROPE_DIM, ROPE_PAD, True, UPCAST, PRECISION)
    offs_lat = tl.arange(0, LATENT_PAD)
    part = (token * num_heads + heads) * NUM_SPLITS + split  # merged by _merge_token_splits_kernel
    _write_rows(m, l, acc, out_ptr, token, heads[:, None], stride_ot, stride_oh, part, h_ok, offs_lat,
                offs_lat < LATENT_DIM, part_out_ptr, part_max_ptr, part_sum_ptr, LATENT_DIM, NUM_SPLITS)


@triton.jit
def _merge_token_splits_kernel(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, num_heads, stride_ot, stride_oh,
                               LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                               SPLITS_PAD: tl.constexpr):
    """One (token, head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m); zeros if nothing was
    chosen."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    used = splits < NUM_SPLITS
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=used, other=-1.0e30)
    w = tl.where(used, tl.exp2(m - tl.max(m, 0)), 0.0)
    l = tl.sum(w * tl.load(part_sum_ptr + part, mask=used, other=0.0), 0)
    offs = tl.arange(0, LATENT_PAD)
    d_ok = offs < LATENT_DIM
    acc = tl.load(part_out_ptr + part[:, None] * LATENT_DIM + offs[None, :], mask=used[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# Splits of the chosen positions: until a launch reaches the device's target of programs (the caller's, from
# attention/triton_backend.py's `target_programs`: two per SM), each split reading at least two tiles, and at most
# this many (the merge holds every split's partial row in registers).
_MAX_SPLITS = 16


def sparse_splits(tokens: int, head_blocks: int, top_k: int, tile: int, target_programs: int) -> int:
    """Splits per (token, head block): a few decodes otherwise leave all but a handful of SMs idle."""
    wanted = -(-target_programs // max(1, tokens * head_blocks))
    return max(1, min(wanted, _MAX_SPLITS, top_k // (2 * tile)))


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, token_req: torch.Tensor,
                         token_pos: torch.Tensor, chosen: torch.Tensor, scale: float, out: torch.Tensor,
                         latent_dim: int, num_splits: int | None = None, target_programs: int = 1) -> torch.Tensor:
    """Absorbed MLA of each query [T, H, latent + rope] at (token_req, token_pos) over only its chosen positions
    [T, k] of its request's paged context, those the module's rule uses: out [T, H, latent_dim] (a query with
    none gets zeros). `num_splits`: runs of the chosen positions computed apart and merged (default:
    `sparse_splits` from the shapes and the device's `target_programs`; 1, the default, never splits)."""
    tokens, heads, dim = q.shape
    if q.stride(-1) != 1 or out.shape != (tokens, heads, latent_dim) or cache.shape[-1] < dim:
        raise ValueError(f"sparse MLA needs q [tokens, heads, latent + rope] (unit last stride), out [tokens, "
                         f"heads, {latent_dim}] and cache entries of at least q's width; got q {tuple(q.shape)}, "
                         f"out {tuple(out.shape)}, cache {tuple(cache.shape)}")
    if tokens == 0:
        return out
    block_h = 16  # heads per program: the M rows of the dots
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    tile = 32 if latent_pad >= 256 else 64
    top_k = chosen.shape[1]
    head_blocks = triton.cdiv(heads, block_h)
    splits = num_splits or sparse_splits(tokens, head_blocks, top_k, tile, target_programs)
    per_split = triton.cdiv(triton.cdiv(top_k, tile), splits) * tile
    partials = split_partials(out, splits)
    _sparse_mla_kernel[(tokens, head_blocks, splits)](
        q, cache, out, block_tables, token_req, token_pos, chosen, *partials, heads, top_k, per_split,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), chosen.stride(0), LATENT_DIM=latent_dim, LATENT_PAD=latent_pad,
        ROPE_DIM=dim - latent_dim, ROPE_PAD=max(16, triton.next_power_of_2(dim - latent_dim)),
        BLOCK_H=block_h, BLOCK_SIZE=cache.shape[1], TILE_N=tile, NUM_SPLITS=splits,
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_CACHE=cache.dtype.itemsize == 1, num_warps=8 if latent_pad >= 256 else 4, num_stages=2)
    if splits > 1:
        _merge_token_splits_kernel[(tokens, heads)](
            out, *partials, heads, out.stride(0), out.stride(1), LATENT_DIM=latent_dim,
            LATENT_PAD=latent_pad, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)
    return out


def gather_entries(cache: torch.Tensor, block_tables: torch.Tensor, req: int, positions: torch.Tensor) -> torch.Tensor:
    """Cache entries [n, entry] of request `req` at `positions` (torch; for the references)."""
    block_size = cache.shape[1]
    return cache[block_tables[req, positions // block_size].long(), positions % block_size, 0]


def indexer_logits_reference(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                             token_req: torch.Tensor, token_pos: torch.Tensor, index_offset: int) -> torch.Tensor:
    width = block_tables.shape[1] * cache.shape[1]
    out = torch.full((q.shape[0], width), float("-inf"))
    for t, (req, last) in enumerate(zip(token_req.tolist(), token_pos.tolist(), strict=True)):
        if last < 0:
            continue
        keys = gather_entries(cache, block_tables, req, torch.arange(last + 1))[:, index_offset:].float()
        keys = keys[:, :q.shape[-1]]
        scores = torch.relu(q[t].float() @ keys.t() * q.shape[-1] ** -0.5)
        out[t, :last + 1] = weights[t].float() @ scores
    return out


def sparse_mla_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, token_req: torch.Tensor,
                         token_pos: torch.Tensor, chosen: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    out = torch.zeros(*q.shape[:2], latent_dim)
    for t, (req, last) in enumerate(zip(token_req.tolist(), token_pos.tolist(), strict=True)):
        picks = chosen[t][(chosen[t] >= 0) & (chosen[t] <= last)].long()
        if picks.numel() == 0:
            continue
        keys = gather_entries(cache, block_tables, req, picks)[:, :q.shape[-1]].float()
        probs = (q[t].float() @ keys.t() * scale).softmax(dim=-1)
        out[t] = probs @ keys[:, :latent_dim]
    return out
