"""How one memory budget is shared between paged KV blocks (attention layers) and recurrent-state slots (Mamba,
delta-rule layers): live slots for the requests that run at once, as many as can each hold a state and the KV of a
request of `max_model_len` tokens (more slots would sit idle for want of blocks: a request needs both), then, with
prefix caching, KV blocks and state checkpoints in the proportion a cached prefix uses them (one checkpoint per
`checkpoint_interval` tokens)."""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION_FREE_CHECKPOINT_INTERVAL = 256  # tokens between checkpoints when no KV bytes set the scale


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_blocks: int  # KV blocks, the padding block 0 included
    num_live_slots: int  # requests that can hold a state at once (0: no recurrent layers)
    num_checkpoints: int
    checkpoint_interval: int  # tokens between a prompt's checkpoints (0: none)


def default_checkpoint_interval(kv_bytes_per_block: int, state_bytes: int, block_size: int) -> int:
    """The smallest multiple of the block size whose tokens' KV bytes are at least one checkpoint's (vLLM's
    hybrid allocator makes an attention page as large as a state for the same reason)."""
    if kv_bytes_per_block == 0:
        return max(block_size, ATTENTION_FREE_CHECKPOINT_INTERVAL // block_size * block_size)
    return max(1, -(-state_bytes // kv_bytes_per_block)) * block_size


def plan_cache(budget: int, kv_bytes_per_block: int, state_bytes: int, block_size: int, checkpoint_interval: int,
               max_num_seqs: int, caching: bool, bookkeeping_blocks: int, max_model_len: int) -> CachePlan:
    """`budget` bytes for KV blocks of `kv_bytes_per_block` and states of `state_bytes` per request.
    `bookkeeping_blocks`: the block count of a model without KV (its blocks cost nothing)."""
    min_kv = 2 * kv_bytes_per_block
    if budget < state_bytes + min_kv:
        raise ValueError(f"The cache budget of {budget / (1 << 20):.1f} MiB holds no request: one request's "
                         f"recurrent state takes {state_bytes / (1 << 20):.1f} MiB"
                         + (f" and the KV cache needs at least {min_kv / (1 << 20):.2f} MiB" if min_kv else "")
                         + "; give the cache more memory (kv_cache_memory_gib / gpu_memory_utilization).")
    interval = checkpoint_interval if caching else 0
    # per KV block, the share of a checkpoint its tokens use: block_size / interval
    per_block = kv_bytes_per_block + (state_bytes * block_size / interval if interval and kv_bytes_per_block else 0)
    request = state_bytes + -(-max_model_len // block_size) * per_block
    live = max(1, min(max_num_seqs, int((budget - min_kv) // request)))
    rest = budget - live * state_bytes
    if kv_bytes_per_block == 0:
        checkpoints = rest // state_bytes if interval else 0
        return CachePlan(bookkeeping_blocks, live, checkpoints, interval)
    num_blocks = max(2, int(rest // per_block))
    checkpoints = (rest - num_blocks * kv_bytes_per_block) // state_bytes if interval else 0
    return CachePlan(num_blocks, live, max(0, checkpoints), interval)
