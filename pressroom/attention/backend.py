"""The attention-backend interface and the per-step metadata every layer reads.

Each backend's metadata builder (`AttentionBackend.make_metadata_builder`) turns a step's flat batch
into one `AttentionMetadata`, making the backend's launch choices (index dtypes, split-KV counts); the
model runner installs it with `forward_context`, and attention layers fetch it, so model code never
threads it through calls. Requests are ordered decodes first (one query token each), then prefill chunks.
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from pressroom.attention.state import StateMetadata


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
    num_kv_splits: int = 1  # split-KV partitions per decode (flash-decoding), chosen by the backend's builder
    plan: object = None  # a backend's per-step precomputation, made by the first layer and reused by the rest
    state: StateMetadata | None = None  # recurrent layers' slots and rounds (models with a recurrent state)
    # Every layer's module must run its own forward: hooks on them change the step (LoRA adapters), which the
    # fused CPU decode stacks would skip (CUDA graphs captured with the adapters run them).
    layer_by_layer: bool = False


class AttentionMetadataBuilder:
    """Builds a step's `AttentionMetadata` for one backend and owns its launch choices. This one serves
    backends that need nothing more: one split per decode, int64 index tensors (the CPU's)."""

    index_dtype = torch.int64  # block tables and context lengths
    needs_device_query_start_loc = False  # whether `build` wants `query_start_loc_device`

    def __init__(self, device: torch.device | str, num_kv_heads: int, max_blocks_per_seq: int) -> None:
        self.device = torch.device(device)
        self.num_kv_heads, self.max_blocks_per_seq = num_kv_heads, max_blocks_per_seq
        self.decode_graph_sizes: list[int] = []  # padded request counts of captured decode graphs

    def split_as_graphs(self, decode_sizes: list[int]) -> None:
        """Decode batches of at most the largest size pad to the next of `decode_sizes` (captured CUDA
        graphs): a step is split as the graph of its padded size is, so graph and eager runs agree."""
        self.decode_graph_sizes = sorted(decode_sizes)

    def padded_decodes(self, num_decodes: int) -> int:
        sizes = self.decode_graph_sizes
        if sizes and 0 < num_decodes <= sizes[-1]:
            return sizes[bisect.bisect_left(sizes, num_decodes)]
        return num_decodes

    def num_kv_splits(self, num_decodes: int) -> int:
        """Split-KV partitions per decode of a step with `num_decodes` single-token requests."""
        return 1

    def build(self, num_decodes: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: list[int], seq_lens_host: list[int], max_query_len: int,
              query_start_loc_device: torch.Tensor | None = None) -> AttentionMetadata:
        """`block_tables` and `seq_lens` in `index_dtype` on the device; `query_start_loc_device` (int32) where
        the caller has it on the device already (the builder makes it from the host list where it needs it)."""
        if query_start_loc_device is None and self.needs_device_query_start_loc:
            query_start_loc_device = torch.tensor(query_start_loc, dtype=torch.int32)
            if self.device.type == "cuda":
                query_start_loc_device = query_start_loc_device.pin_memory().to(self.device, non_blocking=True)
        return AttentionMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=slot_mapping,
            block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            seq_lens_host=seq_lens_host, query_start_loc_device=query_start_loc_device,
            max_query_len=max_query_len, num_kv_splits=self.num_kv_splits(num_decodes))


class AttentionBackend(Protocol):
    def make_metadata_builder(self, device: torch.device | str, num_kv_heads: int,
                              max_blocks_per_seq: int) -> AttentionMetadataBuilder:
        """The builder of this backend's per-step metadata for a cache of `num_kv_heads` heads whose block
        tables hold up to `max_blocks_per_seq` blocks."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; kv_cache: [2, blocks, block_size, kv_heads, dim].
        Writes k, v into the cache at `meta.slot_mapping`, returns [tokens, heads, dim]. `window`: a query at
        position p attends to keys at positions p - window + 1 .. p only (None: all up to p). `sinks` [heads]
        (gpt-oss): one more logit per head in each softmax's denominator, with no value (None: none)."""
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


def get_state_metadata() -> StateMetadata:
    """The step's recurrent-state metadata (attention/state.py), for layers that keep a state per request."""
    meta = get_attention_metadata().state
    if meta is None:
        raise RuntimeError("a recurrent layer ran in a step without state metadata")
    return meta
