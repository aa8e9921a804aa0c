"""The attention-backend interface and the per-step metadata every layer reads.

The model runner builds one `AttentionMetadata` per step and installs it with
`forward_context`; attention layers fetch it, so model code never threads it through calls.
Requests are ordered decodes first (one query token each), then prefill chunks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int  # the first `num_decodes` requests have exactly one query token
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # [num_reqs] context length after this step (int64 on the CPU, int32 on CUDA)
    query_start_loc: list[int]  # [num_reqs + 1], host copy: prefill loops slice by it
    seq_lens_host: list[int]
    # Read by the GPU backend, which never looks at host lists (a CUDA graph replays without them).
    query_start_loc_device: torch.Tensor | None = None  # int32 [num_reqs + 1]
    max_query_len: int = 0
    num_kv_splits: int = 1  # split-KV partitions per decode (flash-decoding), chosen by the runner
    plan: object = None  # a backend's per-step precomputation, made by the first layer and reused by the rest


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; kv_cache: [2, blocks, block_size, kv_heads, dim].
        Writes k, v into the cache at `meta.slot_mapping`, returns [tokens, heads, dim]."""
        ...


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata):
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context")
    return _current
