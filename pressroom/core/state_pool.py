"""State slots of models with recurrent layers (Mamba, delta rule): one live slot per running request, and
checkpoint slots that hold a prompt's state at a block boundary for prefix caching.

Slot ids index every recurrent layer's state tensors. Slot 0 is padding (never handed out); live slots are
1..num_live; checkpoint slots follow. A checkpoint is keyed by the hash of the block that ends at its boundary
(core/block_pool.py's chained hash, so it stands for every token before it). It is reserved when a step is
scheduled to write it, and findable only once that step's output is back (`commit`); it goes when its block's
hash is evicted from the block pool (`drop`), or, least recently used first, when a new checkpoint needs room.
"""
from __future__ import annotations

from collections import OrderedDict

from pressroom.core.block_pool import BlockHash


class StatePool:
    def __init__(self, num_live: int, num_checkpoints: int) -> None:
        if num_live < 1:
            raise ValueError("The state cache has no room for one request's recurrent state; give it more memory.")
        self.num_live, self.num_checkpoints = num_live, num_checkpoints
        self.free_live = list(range(num_live, 0, -1))  # popped from the end: slot 1 first
        first = num_live + 1
        self.free_checkpoints = list(range(first + num_checkpoints - 1, first - 1, -1))
        self.checkpoints: OrderedDict[BlockHash, int] = OrderedDict()  # committed, least recently used first
        self.reserved: dict[BlockHash, int] = {}  # written by a step whose output is not back yet

    @property
    def num_slots(self) -> int:
        """Rows every recurrent layer's state tensors need (slot 0 included)."""
        return 1 + self.num_live + self.num_checkpoints

    @property
    def num_free_live(self) -> int:
        return len(self.free_live)

    def allocate_live(self) -> int | None:
        return self.free_live.pop() if self.free_live else None

    def release_live(self, slot: int) -> None:
        self.free_live.append(slot)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The committed checkpoint of this boundary (marked as just used), or None."""
        slot = self.checkpoints.get(block_hash)
        if slot is not None:
            self.checkpoints.move_to_end(block_hash)
        return slot

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self.checkpoints or block_hash in self.reserved

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for a step to write this boundary's checkpoint into, evicting the least recently used
        committed one if none is free; None when every checkpoint slot is reserved (or there are none)."""
        if self.free_checkpoints:
            slot = self.free_checkpoints.pop()
        elif self.checkpoints:
            _, slot = self.checkpoints.popitem(last=False)
        else:
            return None
        self.reserved[block_hash] = slot
        return slot

    def commit(self, block_hashes: list[BlockHash], keep: bool = True) -> None:
        """The step that wrote these checkpoints is done: findable from now on (`keep`), or given back (the
        step failed, or the block they belong to is gone)."""
        for block_hash in block_hashes:
            slot = self.reserved.pop(block_hash, None)
            if slot is None:
                continue
            if keep:
                self.checkpoints[block_hash] = slot
            else:
                self.free_checkpoints.append(slot)

    def drop(self, block_hash: BlockHash) -> None:
        """The block this checkpoint ends is evicted: its state goes with it."""
        slot = self.checkpoints.pop(block_hash, None)
        if slot is not None:
            self.free_checkpoints.append(slot)

    def reset(self) -> None:
        self.free_checkpoints.extend(self.checkpoints.values())
        self.checkpoints.clear()
