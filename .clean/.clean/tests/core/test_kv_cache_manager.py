"""Block pool ref counts, LRU eviction of cached free blocks, and prefix lookups."""
from __future__ import annotations

from pressroom.core.block_pool import BlockPool, hash_block_tokens
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.request import Request
from pressroom.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_id=None)


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, [9, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(b, [5, 6, 7, 8])
    assert hash_block_tokens(a, [5, 6, 7, 8]) == hash_block_tokens(a, [5, 6, 7, 8])
    assert hash_block_tokens(a, [5, 6, 7, 8], b"lora-1") != hash_block_tokens(a, [5, 6, 7, 8])


def test_pool_reserves_block_zero_and_counts_refs():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert 0 not in [b.block_id for b in blocks]
    pool.touch(blocks[:1])
    pool.release(blocks)
    assert pool.num_free_blocks == 3 and blocks[0].ref_cnt == 1


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    first = _req("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    second = _req("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(second)
    assert n == 8 and [b.block_id for b in hits] == kv.block_ids("a")[:2]
    # A prompt made only of cached full blocks still computes its last token.
    exact = _req("c", list(range(8)))
    assert kv.get_computed_blocks(exact)[1] == 4
    assert kv.stats.queries == 18 and kv.stats.hits == 12


def test_freed_cached_blocks_stay_findable_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    b = _req("b", list(range(8)) + [5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 1, hits)
    kv.free(b)
    # Needing every block evicts the cached ones (LRU, tail of the freed request first).
    c = _req("c", [7] * 12)
    assert kv.allocate_slots(c, 12)
    assert kv.get_computed_blocks(_req("d", list(range(8)) + [1]))[1] == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)  # 2 usable blocks
    r = _req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.pool.num_free_blocks == 2 and kv.block_ids("a") == []
