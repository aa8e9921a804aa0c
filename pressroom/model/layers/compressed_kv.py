"""A paged cache of compressed KV entries (DeepSeek-V4's CSA and HCA): one entry per `rate` consecutive tokens,
addressed through the same block tables as the tokens, so the allocator, prefix caching and the memory accounting
treat it as one more attention layer.

Entry w summarises tokens w * rate .. w * rate + rate - 1 and lives in the block that holds its last token. Where
block_size >= rate (block_size % rate == 0), a block holds block_size // rate entries and entry w sits at offset
(w * rate % block_size) // rate; where rate > block_size (rate % block_size == 0), a block holds one entry slot,
used by the block that closes a window. Either way the flat slot of the entry a token closes is
(token slot // block_size) * entries_per_block + (token slot % block_size) // rate.
"""
from __future__ import annotations

import torch

from pressroom.model.layers.attention import Attention


class CompressedKVCache(Attention):
    """Bound by the model runner like any `Attention` (it allocates `cache_shape`); its owner writes and reads it
    (`write`, `read`), it never runs the attention backend. `entry_dim`: values per entry (CSA: the compressed
    KV, then the indexer's compressed key)."""

    def __init__(self, entry_dim: int, rate: int) -> None:
        super().__init__(num_heads=1, head_dim=entry_dim, num_kv_heads=1, scale=1.0, latent=True)
        self.rate = rate

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.rate and self.rate % block_size:
            raise ValueError(f"block_size {block_size} and the compression rate {self.rate} must divide one "
                             "another: a block holds whole windows, or a window whole blocks.")
        return max(1, block_size // self.rate)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, self.entries_per_block(block_size), 1, self.head_dim)

    def slots_of_tokens(self, token_slots: torch.Tensor, block_size: int) -> torch.Tensor:
        """The flat entry slot of the window each token (by its KV slot) belongs to; meaningful for a window's
        last token, where the entry is written."""
        per_block = self.entries_per_block(block_size)
        return token_slots // block_size * per_block + token_slots % block_size // self.rate

    def entry_slots(self, block_table: torch.Tensor, count: int, block_size: int) -> torch.Tensor:
        """Flat slots of entries 0 .. count - 1 of the sequences of `block_table` ([..., blocks] -> [..., count])."""
        last = torch.arange(count, device=block_table.device) * self.rate + self.rate - 1
        return block_table[..., last // block_size].long() * self.entries_per_block(block_size) \
            + last % block_size // self.rate

    def write(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Entries at their flat slots; a negative slot (a token with no cache slot: the memory profile's pass)
        is skipped."""
        keep = slots >= 0
        if not bool(keep.all()):
            slots, entries = slots[keep], entries[keep]
        self.kv_cache.view(-1, self.head_dim).index_copy_(0, slots, entries.to(self.kv_cache.dtype))

    def read(self, block_table: torch.Tensor, count: int, block_size: int) -> torch.Tensor:
        """Entries 0 .. count - 1 of the sequences of `block_table`: [..., count, entry_dim]."""
        return self.kv_cache.view(-1, self.head_dim)[self.entry_slots(block_table, count, block_size)]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("a compressed KV cache is written and read by its owner, never run as attention.")
