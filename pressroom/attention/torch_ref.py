"""Paged attention in plain torch: the CPU backend and the reference the GPU kernels are tested against."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.attention.backend import AttentionMetadata, AttentionMetadataBuilder
from pressroom.kernels import cpu as cpu_kernels


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """A latent cache (one plane) takes the keys only: its values are a prefix of them."""
    _, _, _, heads, dim = kv_cache.shape
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    if kv_cache.shape[0] == 2:
        kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def cache_planes(kv_cache: torch.Tensor, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches [blocks, block_size, kv_heads, dim]: a latent cache's values are a view
    of its keys' first v_dim dimensions."""
    if kv_cache.shape[0] == 1:
        return kv_cache[0], kv_cache[0][..., :v_dim]
    return kv_cache[0], kv_cache[1]


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
              v_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first `length` tokens: [kv_heads, length, dim] each."""
    block_size = kv_cache.shape[2]
    blocks = block_table[:-(-length // block_size)]
    key_cache, value_cache = cache_planes(kv_cache, v_dim or kv_cache.shape[-1])
    k = key_cache[blocks].flatten(0, 1)[:length]
    v = value_cache[blocks].flatten(0, 1)[:length]
    return k.transpose(0, 1), v.transpose(0, 1)


def _fresh_run_end(loc: list[int], lens: list[int], i: int) -> int:
    """End of the run of requests from i that are whole, uncached chunks of one common length."""
    n = loc[i + 1] - loc[i]
    j = i
    while j < len(loc) - 1 and loc[j + 1] - loc[j] == n and lens[j] == n:
        j += 1
    return max(j, i + 1)


# A request with at most this many query tokens after a cached context (a verification of up to 15
# drafts, a short chunk) is split into single-token rows for the decode path: row j attends to its
# context up to and including its own token, which is exactly the causal mask, and all rows share one
# batched call.
_ROWS_MAX_QUERY = 16


@dataclass(slots=True)
class _Plan:
    rows: torch.Tensor | None  # flat token index of each decode-like row; None: the first num_decodes tokens
    num_rows: int
    tables: torch.Tensor  # [rows, max_blocks]
    lens: torch.Tensor  # [rows] context length each row attends to
    max_len: int
    min_len: int
    chunks: list[int]  # requests left to the prefill path
    seeing_ahead: frozenset[int] = frozenset()  # chunks with tokens that see past themselves (their own mask)


def decode_row_plan(meta: AttentionMetadata, all_rows: bool = False, seeing_ahead: frozenset[int] = frozenset()
                    ) -> _Plan:
    """Which query tokens run as rows of the decode kernel, and the requests left to the prefill path (the CPU's
    fused decode stack asks too). `all_rows`: every query token becomes a row (batch-invariant mode);
    `seeing_ahead`: requests whose tokens see keys past themselves, which only the prefill path masks."""
    loc, lens, nd = meta.query_start_loc, meta.seq_lens_host, meta.num_decodes
    short = [i for i in range(nd, len(loc) - 1) if i not in seeing_ahead
             and (all_rows or loc[i + 1] - loc[i] <= _ROWS_MAX_QUERY and lens[i] > loc[i + 1] - loc[i])]
    chunks = sorted(set(range(nd, len(loc) - 1)) - set(short))
    if not short:
        row_lens = lens[:nd]
        return _Plan(None, nd, meta.block_tables[:nd], meta.seq_lens[:nd], max(row_lens, default=0),
                     min(row_lens, default=0), chunks, seeing_ahead)
    reqs, index, row_lens = list(range(nd)), list(range(nd)), list(lens[:nd])
    for i in short:
        q = loc[i + 1] - loc[i]
        reqs += [i] * q
        index += range(loc[i], loc[i + 1])
        row_lens += range(lens[i] - q + 1, lens[i] + 1)
    return _Plan(torch.tensor(index), len(index), meta.block_tables[torch.tensor(reqs)],
                 torch.tensor(row_lens, dtype=meta.seq_lens.dtype), max(row_lens), min(row_lens), chunks,
                 seeing_ahead)


def requests_seeing_ahead(meta: AttentionMetadata, see_ahead: torch.Tensor | None) -> frozenset[int]:
    """The step's requests with a token that sees keys past itself (`see_ahead`, Attention.forward's)."""
    if see_ahead is None:
        return frozenset()
    loc = meta.query_start_loc
    ahead = see_ahead.cpu()
    return frozenset(i for i in range(meta.num_decodes, len(loc) - 1) if bool(ahead[loc[i]:loc[i + 1]].any()))


class TorchAttentionBackend:
    """Decodes (and short queries after a cached context, split into rows) batched over padded, masked
    contexts; prefill chunks one request at a time, except runs of uncached equal-length prompts,
    which share one call."""

    def make_metadata_builder(self, device: torch.device | str, num_kv_heads: int,
                              max_blocks_per_seq: int) -> AttentionMetadataBuilder:
        """int64 indices, one split per decode; the step's `decode_row_plan` is made by the first layer that runs."""
        return AttentionMetadataBuilder(device, num_kv_heads, max_blocks_per_seq)

    batch_invariant = False  # only CpuAttentionBackend offers the mode
    sees_ahead = True  # takes `see_ahead` (Attention.forward's bidirectional spans)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                sinks: torch.Tensor | None = None, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """`see_ahead` [tokens]: keys past its own each query token also sees (None: causal); a chunk with such
        tokens runs alone through the prefill path with its own mask (the same for every layer of the step)."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.plan is None:
            meta.plan = decode_row_plan(meta, self.batch_invariant, requests_seeing_ahead(meta, see_ahead))
        plan: _Plan = meta.plan
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        if plan.num_rows:
            v_dim = v.shape[-1]
            if plan.rows is None:
                out[:plan.num_rows] = self._decode(q[:plan.num_rows], kv_cache, plan, scale, v_dim, window, sinks)
            else:
                out[plan.rows] = self._decode(q[plan.rows], kv_cache, plan, scale, v_dim, window, sinks)
        loc, lens = meta.query_start_loc, meta.seq_lens_host
        chunks = plan.chunks
        c = 0
        while c < len(chunks):
            i = chunks[c]
            j = _fresh_run_end(loc, lens, i)
            run = j - i
            if run > 1 and chunks[c:c + run] == list(range(i, j)) and plan.seeing_ahead.isdisjoint(range(i, j)):
                # equal-length prompts, nothing cached
                start, end = loc[i], loc[j]
                out[start:end] = self._fresh_batch(q[start:end], k[start:end], v[start:end], run, scale, window,
                                                   sinks)
                c += run
                continue
            start, end = loc[i], loc[i + 1]
            ahead = see_ahead[start:end] if i in plan.seeing_ahead else None
            out[start:end] = prefill_chunk(q[start:end], k[start:end], v[start:end], kv_cache,
                                           meta.block_tables[i], lens[i], scale, window, sinks, ahead)
            c += 1
        return out

    def _fresh_batch(self, q, k, v, count: int, scale: float, window: int | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        def heads_first(x):
            return x.view(count, -1, *x.shape[1:]).transpose(1, 2)
        n = q.shape[0] // count
        mask = _causal_mask(n, n, window)
        o = attend(heads_first(q), heads_first(k), heads_first(v), mask, mask is None, scale, sinks)
        return o.transpose(1, 2).flatten(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float,
                v_dim: int, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """All single-token rows at once over their padded, masked contexts."""
        n = plan.num_rows
        block_size, heads, dim = kv_cache.shape[2:]
        max_len = plan.max_len
        tables = plan.tables[:, :-(-max_len // block_size)]
        key_cache, value_cache = cache_planes(kv_cache, v_dim)
        k = key_cache[tables].view(n, -1, heads, dim)[:, :max_len].transpose(1, 2)
        v = value_cache[tables].reshape(n, -1, heads, v_dim)[:, :max_len].transpose(1, 2)
        mask = None
        positions = torch.arange(max_len)
        if plan.min_len < max_len:  # ragged contexts: hide each one's padding
            mask = positions < plan.lens[:, None]
        if window is not None and max_len > window:  # and each row's keys before its window
            seen = positions > plan.lens[:, None] - 1 - window
            mask = seen if mask is None else mask & seen
        if mask is not None:
            mask = mask[:, None, None, :]
        return attend(q.unsqueeze(2), k, v, mask, False, scale, sinks).squeeze(2)


def prefill_chunk(q, k, v, kv_cache, block_table, seq_len: int, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk of one prompt, its keys and values already in the cache: causal over the chunk, full over its
    cached prefix (both cut to the window, if any); `see_ahead` [n]: keys past its own each query also sees."""
    n = q.shape[0]
    mask = _causal_mask(n, seq_len, window) if see_ahead is None else _span_mask(n, seq_len, window, see_ahead)
    if seq_len == n:  # nothing cached before the chunk: attend to the fresh k, v directly
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        keys, values = gather_kv(kv_cache, block_table, seq_len, v.shape[-1])
    return attend(q.transpose(0, 1), keys, values, mask, mask is None, scale, sinks).transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., heads, n, dim] queries and [..., kv_heads, length, dim] keys and values; `mask` (bool,
    broadcast to [..., heads, n, length]) or, where None, causal (`causal`) or nothing hidden. `sinks` [heads]
    (gpt-oss): a logit per head that joins each softmax's denominator and adds nothing to the output."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=True)
    n, length = q.shape[-2], k.shape[-2]
    if mask is None:  # causal over fresh keys (n == length), or every key visible
        full = torch.ones(n, length, dtype=torch.bool)
        mask = full.tril() if causal else full
    # The sink as one more key with a zero value, which every query sees. One more dimension makes its logit the
    # head's sink: the queries carry sink / scale there, the sink key 1 and the real keys 0. The key is then the
    # same for every head (GQA keeps working) and the mask stays a bool one, broadcast over heads.
    q = torch.cat((q, (sinks.to(q.dtype) / scale).view(-1, 1, 1).expand(*q.shape[:-1], 1)), dim=-1)
    k = F.pad(k, (0, 1, 0, 1))
    k[..., -1, -1] = 1
    v = F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=F.pad(mask, (0, 1), value=True), scale=scale,
                                          enable_gqa=True)


def _causal_mask(n: int, seq_len: int, window: int | None) -> torch.Tensor | None:
    """Which of `seq_len` keys each of the last `n` queries sees: [n, seq_len] bool; None where that is
    plain causal attention over fresh keys (SDPA's is_causal)."""
    hides_past = window is not None and seq_len > window
    if seq_len == n and not hides_past:
        return None
    query_pos = torch.arange(n)[:, None] + (seq_len - n)
    key_pos = torch.arange(seq_len)[None, :]
    mask = key_pos <= query_pos
    return mask & (key_pos > query_pos - window) if hides_past else mask


def _span_mask(n: int, seq_len: int, window: int | None, see_ahead: torch.Tensor) -> torch.Tensor:
    """`_causal_mask` with each query also seeing its next see_ahead[i] keys (HF's OR of causal and a bidirectional
    block, then AND the window: a key ahead is never outside it)."""
    device = see_ahead.device
    query_pos = torch.arange(n, device=device)[:, None] + (seq_len - n)
    key_pos = torch.arange(seq_len, device=device)[None, :]
    mask = key_pos <= query_pos + see_ahead[:, None]
    return mask & (key_pos > query_pos - window) if window is not None else mask


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decodes handled by a C kernel that reads the paged cache in place.

    `batch_invariant`: every query token, decode or prompt, is a row of the C kernel, which computes each row
    alone (its context in order, its own softmax): a row's bits depend on its context only, never on the
    rows beside it or on how its prompt was chunked. Prompts pay for it (no batched SDPA)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float,
                v_dim: int, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant and (kv_cache.shape[0] == 1 or window is not None or sinks is not None):
            raise ValueError("--batch-invariant does not cover multi-head latent attention (MLA), "
                             "sliding-window attention or attention sinks yet.")
        # A latent cache has keys and values of different widths in one plane; the C kernel knows no sinks.
        if kv_cache.shape[0] == 1 or sinks is not None:
            return super()._decode(q, kv_cache, plan, scale, v_dim, window, sinks)
        out = cpu_kernels.paged_decode(q, kv_cache[0], kv_cache[1], plan.tables, plan.lens, scale, window)
        return out.to(q.dtype)


def make_cpu_backend(cache_dtype: torch.dtype, batch_invariant: bool = False) -> TorchAttentionBackend:
    usable = cache_dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
    if batch_invariant and not usable:
        raise ValueError("--batch-invariant on the CPU needs the C kernels (a C compiler, not "
                         "PRESSROOM_DISABLE_C_KERNELS) and a float32 or bfloat16 KV cache.")
    return CpuAttentionBackend(batch_invariant) if usable else TorchAttentionBackend()
