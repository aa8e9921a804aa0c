"""A rank's side of KV offload: each step, before its forward pass, its KV heads of the step's blocks go
between the device cache and the CPU tier's shared slab (kv_offload/slab.py).

A chunk is head-major, [kv_heads, layers, planes, block_size, head_dim] over the model's KV heads, so one
rank's heads are one contiguous range of it whatever the tensor-parallel size: a chunk written by one TP
size is read by any other. A KV head replicated over several ranks is written by the first of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pressroom.core.outputs import KVTransfers
from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size
from pressroom.kv_offload.slab import MappedSlab, SlabHandle
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.linear import QKVParallelLinear, head_split
from pressroom.worker.device import to_device


@dataclass(slots=True, frozen=True)
class HeadRange:
    """A rank's KV heads within the model's: [first, first + count) of total; `writes`: it stores them."""
    first: int
    count: int
    total: int
    writes: bool = True


def kv_chunk_shape(layers: list[Attention], heads: HeadRange, block_size: int) -> tuple[int, ...]:
    """One block's KV over every attention layer and every KV head of the model, as the offload tiers hold
    it: [kv_heads, layers, planes, block_size, head_dim]."""
    shapes = {layer.cache_shape(1, block_size) for layer in layers}
    if len(shapes) != 1:
        raise ValueError("KV offloading needs every attention layer's cache in one shape; this model's "
                         "layers differ.")
    planes, _, block, _, dim = shapes.pop()
    return (heads.total, len(layers), planes, block, dim)


def kv_head_range(model: torch.nn.Module, layers: list[Attention]) -> HeadRange:
    """This rank's KV heads among the model's (all of them without tensor parallelism)."""
    heads = layers[0].num_kv_heads
    if get_tp_size() == 1:
        return HeadRange(0, heads, heads)
    qkv = next((m for m in model.modules() if isinstance(m, QKVParallelLinear)), None)
    if qkv is None or qkv.num_kv_heads != heads:
        raise ValueError("KV offloading with tensor parallelism needs a model whose attention projects "
                         "keys and values per KV head (QKVParallelLinear); this one does not.")
    rank = get_tp_rank()
    # a replicated KV head is written by the first rank that holds it
    previous = head_split(qkv.total_heads, qkv.total_kv_heads, get_tp_size(), rank - 1) if rank else None
    writes = previous is None or previous[2] != qkv.kv_start
    return HeadRange(qkv.kv_start, heads, qkv.total_kv_heads, writes)


class OffloadCopier:
    def __init__(self, handle: SlabHandle, heads: HeadRange, device: str) -> None:
        self.mapped = MappedSlab(handle)
        self.heads, self.device = heads, device
        self.on_cuda = torch.device(device).type == "cuda"
        # [slots, this rank's heads, layers, planes, block, dim]: one chunk's part is contiguous; several
        # consecutive chunks' parts are too when the rank has every head
        self.slab = self.mapped.tensor[:, heads.first:heads.first + heads.count]
        self.whole = heads.count == heads.total

    def run(self, caches: list[torch.Tensor], transfers: KVTransfers) -> torch.cuda.Event | None:
        """Stores, then loads, on the current stream; on CUDA the event that marks them done (the step's
        output waits for it: the engine returns the slots' loans when every rank's output is back)."""
        if transfers.stores and self.heads.writes:
            self._store(caches, transfers.stores)
        if transfers.loads:
            self._load(caches, transfers.loads)
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _store(self, caches: list[torch.Tensor], stores: list[tuple[int, int]]) -> None:
        ids = to_device(torch.tensor([b for b, _ in stores]), self.device)
        slots = [s for _, s in stores]
        # per layer [planes, n, block, heads, dim] -> [n, heads, layers, planes, block, dim]
        out = torch.stack([cache.index_select(1, ids) for cache in caches]).permute(2, 4, 0, 1, 3, 5)
        if not self.on_cuda:
            self.slab.index_copy_(0, torch.tensor(slots), out)
            return
        out = out.contiguous()
        for i, slot, n in self._spans(slots):
            self.slab[slot:slot + n].copy_(out[i:i + n], non_blocking=True)

    def _load(self, caches: list[torch.Tensor], loads: list[tuple[int, int]]) -> None:
        ids = to_device(torch.tensor([b for b, _ in loads]), self.device)
        slots = [s for _, s in loads]
        if self.on_cuda:
            batch = torch.empty((len(slots), *self.slab.shape[1:]), dtype=self.slab.dtype, device=self.device)
            for i, slot, n in self._spans(slots):
                batch[i:i + n].copy_(self.slab[slot:slot + n], non_blocking=True)
        else:
            batch = self.slab.index_select(0, torch.tensor(slots))
        for layer, cache in enumerate(caches):  # [n, heads, planes, block, dim] -> [planes, n, block, heads, dim]
            cache.index_copy_(1, ids, batch[:, :, layer].permute(2, 0, 3, 1, 4))

    def _spans(self, slots: list[int]):
        """(position, first slot, length) per copy: runs of consecutive slots where the rank's part of them
        is one contiguous range, else one chunk each."""
        if not self.whole:
            return ((i, slot, 1) for i, slot in enumerate(slots))
        return _runs(slots)

    def close(self) -> None:
        self.mapped.close()


def _runs(slots: list[int]):
    """(position, first slot, length) of each run of consecutive slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i
