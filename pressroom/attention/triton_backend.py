"""The CUDA attention backend: Triton kernels for the KV-cache write and the paged attention of a mixed batch
(per-head keys and values, or MLA's latent cache).

One launch serves every request of the step (decodes and prefill chunks with a cached prefix), and
it reads only device tensors from the metadata, so the same call is captured into CUDA graphs.
"""
from __future__ import annotations

import torch

from pressroom.attention.backend import AttentionMetadata, AttentionMetadataBuilder
from pressroom.attention.torch_ref import prefill_chunk, requests_seeing_ahead
from pressroom.kernels.triton.attention import paged_attention
from pressroom.kernels.triton.cache import write_kv
from pressroom.kernels.triton.mla import mla_attention

# Split a decode's context across programs until about this many per multiprocessor run per kernel
# launch: a batch of few long decodes otherwise leaves most of the GPU's multiprocessors idle.
_PROGRAMS_PER_SM = 2
_DEFAULT_SMS = 132  # where no CUDA device answers (the Triton interpreter on the CPU): an H100/H200's count
_MAX_SPLITS = 64  # MLA at batch 1 (one latent head) needs ~64 splits for a wave on an H200 (Kimi-Linear at 128k)
_MIN_BLOCKS_PER_SPLIT = 4


def num_kv_splits(num_decodes: int, num_kv_heads: int, max_blocks_per_seq: int,
                  target_programs: int = _PROGRAMS_PER_SM * _DEFAULT_SMS) -> int:
    """Depends on the batch shape (and the device) only, so a captured graph and an eager step of that
    size agree. `target_programs`: programs a launch should reach (the builder's: from the SM count)."""
    if num_decodes == 0:
        return 1
    wanted = -(-target_programs // (num_decodes * num_kv_heads))
    return max(1, min(wanted, _MAX_SPLITS, max_blocks_per_seq // _MIN_BLOCKS_PER_SPLIT))


def target_programs(device: torch.device | str) -> int:
    """Programs a split launch should reach on `device` (the one rule for split-KV counts: dense decodes here, DSA's
    chosen positions in kernels/triton/dsa.py)."""
    return _PROGRAMS_PER_SM * multiprocessor_count(device)


def multiprocessor_count(device: torch.device | str) -> int:
    """The device's SM count; a default where it is no CUDA device (the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """int32 index tensors and the device-side query starts the kernels read; split-KV counts from the
    padded decode count, the KV heads and this device's own multiprocessor count (read once, here);
    batch-invariant: never a split (how a context is cut would depend on the batch's size)."""

    index_dtype = torch.int32
    needs_device_query_start_loc = True

    def __init__(self, device: torch.device | str, num_kv_heads: int, max_blocks_per_seq: int,
                 batch_invariant: bool = False) -> None:
        super().__init__(device, num_kv_heads, max_blocks_per_seq)
        self.target_programs = target_programs(self.device)
        self.batch_invariant = batch_invariant

    def num_kv_splits(self, num_decodes: int) -> int:
        if self.batch_invariant:
            return 1
        return num_kv_splits(self.padded_decodes(num_decodes), self.num_kv_heads, self.max_blocks_per_seq,
                             self.target_programs)


class TritonAttentionBackend:
    """`batch_invariant`: every query's attention computed the same way in any batch (kernels/triton/
    attention.py's docstring); MLA's latent caches are refused in that mode.

    `see_ahead` (Gemma 3's image tokens see the rest of their image): the kernel's mask is causal, so each prompt
    chunk holding such tokens is computed again by the torch reference with its span mask, over the keys the
    kernel's launch has written. Steps with images run eagerly, so no graph holds it. What the kernel needs instead:
    a per-query key bound, position + see_ahead, in place of the causal one (and the tiles past the diagonal
    visited up to the chunk's largest bound)."""

    sees_ahead = True

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def make_metadata_builder(self, device: torch.device | str, num_kv_heads: int,
                              max_blocks_per_seq: int) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(device, num_kv_heads, max_blocks_per_seq, self.batch_invariant)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                sinks: torch.Tensor | None = None, see_ahead: torch.Tensor | None = None) -> torch.Tensor:
        out = self._forward(q, k, v, kv_cache, meta, scale, window, sinks)
        if see_ahead is None:
            return out
        if meta.plan is None:  # the step's requests that see ahead, found once (a host copy) for every layer
            meta.plan = requests_seeing_ahead(meta, see_ahead)
        for i in meta.plan:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = prefill_chunk(q[start:end], k[start:end], v[start:end], kv_cache, meta.block_tables[i],
                                           meta.seq_lens_host[i], scale, window, sinks, see_ahead[start:end])
        return out

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._refuse_unsupported(kv_cache, window, sinks)  # before anything is written
        write_kv(kv_cache, k, None if kv_cache.shape[0] == 1 else v, meta.slot_mapping)
        return self.attend_cached(q, kv_cache, meta, scale, v.shape[-1], window, sinks)

    def _refuse_unsupported(self, kv_cache: torch.Tensor, window: int | None, sinks: torch.Tensor | None) -> None:
        latent = kv_cache.shape[0] == 1
        if latent and (window is not None or sinks is not None):
            raise ValueError("multi-head latent attention (MLA) takes no sliding window or attention sinks.")
        if self.batch_invariant and (latent or window is not None or sinks is not None):
            raise ValueError("--batch-invariant does not cover multi-head latent attention (MLA), sliding-window "
                             "attention or attention sinks yet.")

    def attend_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      v_dim: int, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """forward's attention over a cache that holds this step's keys and values already (MLA's prepare kernel
        writes its entries itself: one launch fewer a layer); [tokens, heads, v_dim]."""
        self._refuse_unsupported(kv_cache, window, sinks)
        out = q.new_empty(*q.shape[:2], v_dim)
        if kv_cache.shape[0] == 1:  # MLA: one entry per token, its first v_dim values the value vector
            def attend(q, tables, lens, starts, max_query_len, out, splits=1):
                return mla_attention(q, kv_cache[0], tables, lens, starts, max_query_len, scale, out, v_dim, splits)
        else:
            def attend(q, tables, lens, starts, max_query_len, out, splits=1):
                return paged_attention(q, kv_cache, tables, lens, starts, max_query_len, scale, out, splits,
                                       self.batch_invariant, window, sinks)
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc_device
        decodes = meta.num_decodes
        if meta.max_query_len == 1 or not 0 < decodes < tables.shape[0]:
            splits = meta.num_kv_splits if meta.max_query_len == 1 else 1
            return attend(q, tables, lens, starts, meta.max_query_len, out, splits)
        # A mixed step (decodes first, then prompt chunks): two launches, each with its own tile shape, so
        # the decodes do not pay for the 64-row tiles the chunks want. The decodes are the first tokens:
        # their launch sees only those, so a split-KV workspace is sized by them, not by the chunks.
        attend(q[:decodes], tables[:decodes], lens[:decodes], starts[:decodes + 1], 1, out[:decodes],
               meta.num_kv_splits)
        return attend(q, tables[decodes:], lens[decodes:], starts[decodes:], meta.max_query_len, out)
