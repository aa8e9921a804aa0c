"""The CUDA attention backend: Triton kernels for the KV-cache write and the paged attention of a mixed batch.

One launch serves every request of the step (decodes and prefill chunks with a cached prefix), and
it reads only device tensors from the metadata, so the same call is captured into CUDA graphs.
"""
from __future__ import annotations

import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.kernels.triton.attention import paged_attention
from pressroom.kernels.triton.cache import write_kv

# Split a decode's context across programs until about this many run per kernel launch: a batch of
# few long decodes otherwise leaves most of the GPU's multiprocessors idle.
_TARGET_PROGRAMS = 2 * 132
_MAX_SPLITS = 16
_MIN_BLOCKS_PER_SPLIT = 4


def num_kv_splits(num_decodes: int, num_kv_heads: int, max_blocks_per_seq: int) -> int:
    """Depends on the batch shape only, so a captured graph and an eager step of that size agree."""
    if num_decodes == 0:
        return 1
    wanted = -(-_TARGET_PROGRAMS // (num_decodes * num_kv_heads))
    return max(1, min(wanted, _MAX_SPLITS, max_blocks_per_seq // _MIN_BLOCKS_PER_SPLIT))


class TritonAttentionBackend:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc_device
        decodes = meta.num_decodes
        if meta.max_query_len == 1 or not 0 < decodes < tables.shape[0]:
            splits = meta.num_kv_splits if meta.max_query_len == 1 else 1
            return paged_attention(q, kv_cache, tables, lens, starts, meta.max_query_len, scale, out, splits)
        # A mixed step (decodes first, then prompt chunks): two launches, each with its own tile shape, so
        # the decodes do not pay for the 64-row tiles the chunks want. The decodes are the first tokens:
        # their launch sees only those, so a split-KV workspace is sized by them, not by the chunks.
        paged_attention(q[:decodes], kv_cache, tables[:decodes], lens[:decodes], starts[:decodes + 1], 1, scale,
                        out[:decodes], meta.num_kv_splits)
        return paged_attention(q, kv_cache, tables[decodes:], lens[decodes:], starts[decodes:], meta.max_query_len,
                               scale, out)
