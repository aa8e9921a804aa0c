"""Which blocks each request owns, prefix-cache lookups, and the hit counters."""
from __future__ import annotations

from dataclasses import dataclass

from pressroom.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pressroom.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix, leaving at least one token to compute so the step has logits."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        hits = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] = ()) -> bool:
        """Reserve room for `num_new_tokens` more; False (and nothing changed) if the pool is too small."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - free_hits:
            return False
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        # Only blocks whose tokens are all known: an input still in flight (async scheduling) waits.
        self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens) // self.block_size)
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.release(blocks[::-1])
        self.req_hashes.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids_between(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]
