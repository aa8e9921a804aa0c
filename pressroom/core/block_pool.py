"""Fixed-size KV blocks with reference counts and a hash index of full blocks for prefix caching.

Free blocks sit in an LRU queue; a free block that still holds a cached prefix stays findable by
its hash until the queue hands it out again, at which point its hash is evicted.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Chained hash: a block's identity covers every token before it and anything else that changes its KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}; give it more memory.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Block 0 is never handed out: padded block-table entries point at it.
        self.blocks[0].ref_cnt = 1
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}
        self.on_evict: Callable[[BlockHash], None] | None = None  # told of each hash that stops being findable

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block pulls it out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; callers pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is cached already; this copy stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks[1:]:
            self._evict(block)
