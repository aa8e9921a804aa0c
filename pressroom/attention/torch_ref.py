"""Paged attention in plain torch: the CPU backend and the reference the GPU kernels are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pressroom.attention.backend import AttentionMetadata
from pressroom.kernels import cpu as cpu_kernels


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, _, _, heads, dim = kv_cache.shape
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first `length` tokens: [kv_heads, length, dim] each."""
    block_size = kv_cache.shape[2]
    blocks = block_table[:-(-length // block_size)]
    k = kv_cache[0, blocks].flatten(0, 1)[:length]
    v = kv_cache[1, blocks].flatten(0, 1)[:length]
    return k.transpose(0, 1), v.transpose(0, 1)


def _fresh_run_end(loc: list[int], lens: list[int], i: int) -> int:
    """End of the run of requests from i that are whole, uncached chunks of one common length."""
    n = loc[i + 1] - loc[i]
    j = i
    while j < len(loc) - 1 and loc[j + 1] - loc[j] == n and lens[j] == n:
        j += 1
    return max(j, i + 1)


class TorchAttentionBackend:
    """Decodes batched over padded, masked contexts; prefill chunks one request at a time, except
    runs of uncached equal-length prompts, which share one call."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if meta.num_decodes:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        loc, lens = meta.query_start_loc, meta.seq_lens_host
        i = meta.num_decodes
        while i < len(loc) - 1:
            j = _fresh_run_end(loc, lens, i)
            start, end = loc[i], loc[j]
            if j - i > 1:  # equal-length prompts with nothing cached: one batched call
                out[start:end] = self._fresh_batch(q[start:end], k[start:end], v[start:end], j - i, scale)
            else:
                out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], kv_cache,
                                               meta.block_tables[i], lens[i], scale)
            i = j
        return out

    def _fresh_batch(self, q, k, v, count: int, scale: float) -> torch.Tensor:
        def heads_first(x):
            return x.view(count, -1, *x.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o.transpose(1, 2).flatten(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """All single-token queries at once over their padded, masked contexts."""
        n = meta.num_decodes
        block_size, heads, dim = kv_cache.shape[2:]
        max_len = meta.max_decode_seq_len
        tables = meta.block_tables[:n, :-(-max_len // block_size)]
        k = kv_cache[0, tables].view(n, -1, heads, dim)[:, :max_len].transpose(1, 2)
        v = kv_cache[1, tables].view(n, -1, heads, dim)[:, :max_len].transpose(1, 2)
        mask = None
        if min(meta.seq_lens_host[:n]) < max_len:  # ragged contexts: hide each one's padding
            mask = (torch.arange(max_len) < meta.seq_lens[:n, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, block_table, seq_len: int, scale: float) -> torch.Tensor:
        """One chunk of one prompt: causal over the chunk, full over its cached prefix."""
        n = q.shape[0]
        if seq_len == n:  # nothing cached before the chunk: attend to the fresh k, v directly
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True,
                                               scale=scale, enable_gqa=True)
            return o.transpose(0, 1)
        keys, values = gather_kv(kv_cache, block_table, seq_len)
        prefix = seq_len - n
        mask = torch.arange(seq_len)[None, :] <= (torch.arange(n)[:, None] + prefix)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        return o.transpose(0, 1)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decodes handled by a C kernel that reads the paged cache in place."""

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        n = meta.num_decodes
        out = cpu_kernels.paged_decode(q, kv_cache[0], kv_cache[1], meta.block_tables[:n], meta.seq_lens[:n], scale)
        return out.to(q.dtype)


def make_cpu_backend(cache_dtype: torch.dtype) -> TorchAttentionBackend:
    usable = cache_dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
    return CpuAttentionBackend() if usable else TorchAttentionBackend()
