"""Which blocks each request owns, prefix-cache lookups, and the hit counters.

With KV offload on (`offload`, a kv_offload.TieredKVStore), a prefix lookup goes on in the tiers past the
device's hits, and a request's released blocks are queued for storing; the scheduler hands both kinds of
copy to the workers with its next step (`take_transfers`) and tells the store when that step's output is
back (`transfers_done`).

A model with recurrent layers (Mamba, delta rule) also holds a state slot per running request (`states`, a
core.state_pool.StatePool): admission needs a free one as it needs blocks. With prefix caching, a prompt's state
is checkpointed every `checkpoint_interval` tokens (a multiple of the block size) as its step passes the
boundary; a prefix hit then ends at the longest boundary whose checkpoint is still held, and the request's
live slot starts as a copy of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pressroom.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pressroom.core.outputs import KVTransfers
from pressroom.core.request import Request
from pressroom.core.state_pool import StatePool
from pressroom.kv_offload.manager import OffloadHit


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, offload: Any = None,
                 states: StatePool | None = None, checkpoint_interval: int = 0) -> None:
        self.block_size = block_size
        self.offload = offload
        self._stores: list[tuple[int, str, list[int]]] = []  # (device block, chunk key, its tokens) to copy out
        self._loads: list[tuple[int, int]] = []  # (device block, lent CPU slot) to copy in before the forward
        self._storing: set[str] = set()
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.states = states
        self.checkpoint_interval = checkpoint_interval
        self.live_slots: dict[str, int] = {}
        self._restore: dict[str, int] = {}  # request -> checkpoint slot its admission starts from
        self._saves: dict[str, list[tuple[int, int]]] = {}  # this step's checkpoint writes (see take_state_saves)
        self._written: dict[int, BlockHash] = {}  # reserved checkpoint slot -> its boundary's hash
        if states is not None:
            self.pool.on_evict = states.drop

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
        if self.states is not None:
            hits = self._hits_with_checkpoint(request, hashes, hits)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def offloaded_chunks(self, request: Request, num_device_hits: int) -> OffloadHit | tuple | None:
        """What the offload tiers hold of the prompt's blocks after its device hits (a kv_offload.OffloadHit:
        the leading chunks, in order; what they do not hold is computed; () when offload is off), or None
        while some are still being read from a secondary tier: the request should wait, the batch goes on.
        A hit's CPU slots are on loan until `allocate_slots` takes it (or gives it back)."""
        if self.offload is None or not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return ()
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        return self.offload.lookup([h.hex() for h in hashes[num_device_hits:]],
                                   lambda i: self._block_tokens(request, num_device_hits + i))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] = (), loaded: OffloadHit | tuple = ()) -> bool:
        """Reserve room for `num_new_tokens` more; False (and nothing changed) if the pool is too small.
        `loaded` (an offloaded_chunks hit) follows the device hits: fresh blocks take its chunks before the
        step's forward pass."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_hit_blocks = len(new_computed_blocks) + len(loaded)
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        no_state = self.states is not None and request.request_id not in self.live_slots \
            and not self.states.num_free_live
        if num_needed > self.pool.num_free_blocks - free_hits or no_state:
            if loaded:
                self.offload.release(loaded)
            return False
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        if num_needed > 0:
            fresh = self.pool.allocate(num_needed)
            if loaded:
                self._loads.extend((b.block_id, slot) for b, slot in zip(fresh, loaded.slots))
            blocks.extend(fresh)
        if isinstance(loaded, OffloadHit):
            self.offload.count_lookup(loaded)
        # Only blocks whose tokens are all known: an input still in flight (async scheduling) waits.
        self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens) // self.block_size)
        if self.states is not None:
            self._take_live_slot(request, bool(new_computed_blocks))
            self._plan_checkpoints(request, num_computed, num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        if self.offload is not None:
            self._queue_stores(request)
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.release(blocks[::-1])
        self.req_hashes.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self._restore.pop(request.request_id, None)
        slot = self.live_slots.pop(request.request_id, None)
        if slot is not None:
            self.states.release_live(slot)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.states is not None:
            self.states.reset()

    # ---- recurrent states ----

    def state_slots(self, request_id: str) -> tuple[int, int]:
        """A newly admitted request's (live slot, checkpoint slot it starts from or -1: zeros); (-1, -1) for a
        model without recurrent layers."""
        if self.states is None:
            return -1, -1
        return self.live_slots[request_id], self._restore.pop(request_id, -1)

    def take_state_saves(self) -> dict[str, list[tuple[int, int]]]:
        """The step's checkpoint writes: per request, (tokens of its step after which the state is the
        boundary's, checkpoint slot), in order."""
        saves, self._saves = self._saves, {}
        return saves

    def checkpoints_done(self, saves: dict[str, list[tuple[int, int]]], ok: bool = True) -> None:
        """The step that wrote `saves` is over: its checkpoints become findable where it succeeded and their
        blocks are still cached, else their slots go back."""
        for writes in saves.values():
            for _, slot in writes:
                block_hash = self._written.pop(slot)
                self.states.commit([block_hash], keep=ok and self.pool.lookup(block_hash) is not None)

    def _hits_with_checkpoint(self, request: Request, hashes: list[BlockHash], hits: list[KVBlock]
                              ) -> list[KVBlock]:
        """The block hits cut back to the longest boundary whose state is checkpointed: the recurrent layers
        cannot start anywhere else (no checkpoint: no hit at all)."""
        per_checkpoint = self.checkpoint_interval // self.block_size
        for k in range(len(hits) // per_checkpoint * per_checkpoint, 0, -per_checkpoint):
            slot = self.states.lookup(hashes[k - 1])
            if slot is not None:
                self._restore[request.request_id] = slot
                return hits[:k]
        self._restore.pop(request.request_id, None)
        return []

    def _take_live_slot(self, request: Request, restored: bool) -> None:
        if request.request_id not in self.live_slots:
            self.live_slots[request.request_id] = self.states.allocate_live()
            if not restored:
                self._restore.pop(request.request_id, None)

    def _plan_checkpoints(self, request: Request, num_computed: int, num_new_tokens: int) -> None:
        """Reserves a checkpoint for each boundary of the prompt this step's tokens pass (none already held)."""
        interval = self.checkpoint_interval
        if not self.enable_caching or not interval:
            return
        end = min(num_computed + num_new_tokens, request.num_prompt_tokens)
        for boundary in range((num_computed // interval + 1) * interval, end + 1, interval):
            block_hash = self._hashes(request, boundary // self.block_size)[-1]
            if self.states.has(block_hash):
                continue
            slot = self.states.reserve(block_hash)
            if slot is None:
                return
            self._written[slot] = block_hash
            self._saves.setdefault(request.request_id, []).append((boundary - num_computed, slot))

    def take_transfers(self) -> KVTransfers | None:
        """The copies the next step runs first (None: none): stores (device block -> a CPU slot reserved
        for its chunk), then loads (a lent CPU slot -> device block)."""
        if not self._stores and not self._loads:
            return None
        stores, loads, self._stores, self._loads = self._stores, self._loads, [], []
        self._storing.clear()
        return self.offload.start_transfers(stores, loads)

    def transfers_done(self, transfers: KVTransfers | None, ok: bool = True) -> None:
        """A step's output is back (`ok`), or the step failed: the offload store takes back its slots."""
        if transfers is None:
            return
        if ok:
            self.offload.finish_transfers(transfers)
        else:
            self.offload.abandon_transfers(transfers)

    @property
    def has_transfers(self) -> bool:
        """Copies queued for a step, or made by one whose output is not back yet: the engine keeps
        stepping until they are done, so chunks reach the tiers even when no request follows."""
        return bool(self._stores or self._loads or self.offload is not None and self.offload.in_flight)

    def _queue_stores(self, request: Request) -> None:
        """A released request's full blocks whose KV is computed and that no tier holds yet."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(len(blocks), min(request.num_computed_tokens, request.num_tokens - 1) // self.block_size)
        for i, (block, block_hash) in enumerate(zip(blocks[:num_full], self._hashes(request, num_full))):
            key = block_hash.hex()
            if key not in self._storing and not self.offload.holds(key):
                self._storing.add(key)
                self._stores.append((block.block_id, key, self._block_tokens(request, i)))

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
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            extra = _first_block_extra(request) if i == 0 else b""
            if request.mm_features:
                extra += self._media_extra(request, i)
            hashes.append(hash_block_tokens(parent, self._block_tokens(request, i), extra))
        return hashes[:num_blocks]

    def _media_extra(self, request: Request, i: int) -> bytes:
        """The content hashes of the media whose placeholder runs meet block `i`: their placeholder ids are all
        alike, so without these two different images would share KV."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        return b"".join(b"\0media:" + m.hash.encode() for m in request.mm_features if m.overlaps(start, end))

    def _block_tokens(self, request: Request, i: int) -> list[int]:
        """The token ids of the request's block `i` (its chunk's header carries their digest)."""
        return request.token_ids_between(i * self.block_size, (i + 1) * self.block_size)


def _first_block_extra(request: Request) -> bytes:
    """What besides its tokens keys a request's first block (the chain carries it to the rest): an adapter's id,
    as its KV differs from the base model's, and the request's cache salt, so that requests with different salts
    (or none) never share blocks. The salt's part starts with a NUL, which an adapter's part never holds."""
    extra = f"lora:{request.lora.lora_int_id}".encode() if request.lora is not None else b""
    if request.cache_salt is not None:
        extra += b"\0salt:" + request.cache_salt.encode("utf-8", "surrogatepass")
    return extra
