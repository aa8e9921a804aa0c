"""A rank's KV offload copies: the chunk is head-major, so ranks holding a few KV heads each write exactly
the chunk one rank holding them all writes, and read their heads back from it; the slab is shared memory
that another process maps and writes into."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pressroom.core.outputs import KVTransfers
from pressroom.kv_offload.slab import MappedSlab, SlabHandle, create_slab
from pressroom.worker.offload_copier import HeadRange, OffloadCopier

LAYERS, PLANES, BLOCKS, BLOCK, HEADS, DIM, SLOTS = 2, 2, 5, 4, 4, 8, 3
CHUNK = (HEADS, LAYERS, PLANES, BLOCK, DIM)


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(PLANES, BLOCKS, BLOCK, HEADS, DIM, generator=gen) for _ in range(LAYERS)]


def copier(heads: HeadRange, handle: SlabHandle | None = None) -> tuple[OffloadCopier, torch.Tensor]:
    owner = None
    if handle is None:
        owner, handle, _ = create_slab((SLOTS, *CHUNK), torch.float32, pin=False)
    return OffloadCopier(handle, heads, "cpu"), owner


def test_ranks_with_some_heads_each_write_the_chunk_one_rank_writes_and_read_their_heads_back():
    full = caches(0)
    whole, expected = copier(HeadRange(0, HEADS, HEADS))
    whole.run(full, KVTransfers(1, [(1, 2), (3, 0)], []))
    # the chunk: [heads, layers, planes, block, dim] of block 1
    assert torch.equal(expected[2], torch.stack(full)[:, :, 1].permute(3, 0, 1, 2, 4))

    first, shared = copier(HeadRange(0, 3, HEADS))  # an uneven split: 3 heads and 1
    ranks = [first, OffloadCopier(first.mapped.handle, HeadRange(3, 1, HEADS), "cpu")]
    for rank, heads in zip(ranks, (slice(0, 3), slice(3, 4))):
        rank.run([c[..., heads, :].contiguous() for c in full], KVTransfers(1, [(1, 2), (3, 0)], []))
    assert torch.equal(shared, expected)

    # loads: each rank takes its heads of the chunks into fresh blocks
    for rank, heads in zip(ranks, (slice(0, 3), slice(3, 4))):
        mine = [torch.zeros(PLANES, BLOCKS, BLOCK, heads.stop - heads.start, DIM) for _ in range(LAYERS)]
        rank.run(mine, KVTransfers(2, [], [(0, 2), (4, 0)]))
        for got, want in zip(mine, full):
            assert torch.equal(got[:, 0], want[:, 1, :, heads]) and torch.equal(got[:, 4], want[:, 3, :, heads])


def test_a_rank_holding_a_replicated_head_after_its_first_holder_does_not_write():
    copy, slab = copier(HeadRange(0, 1, 2, writes=False))
    copy.run([c[..., :1, :] for c in caches(1)], KVTransfers(1, [(0, 0)], []))
    assert not slab.any()


def test_the_slab_is_shared_with_another_process_and_a_wrong_handle_is_refused():
    slab, handle, _ = create_slab((SLOTS, 4), torch.float32, pin=False)
    code = ("import sys, torch; from pressroom.kv_offload.slab import MappedSlab, SlabHandle; "
            f"MappedSlab(SlabHandle({handle.path!r}, {handle.inode}, {handle.shape!r}, torch.float32, False))"
            ".tensor[1].fill_(7)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert slab[1].tolist() == [7.0] * 4 and not slab[0].any()
    _, other, _ = create_slab((SLOTS, 4), torch.float32, pin=False)
    with pytest.raises(ValueError, match="not the CPU tier's shared memory"):
        MappedSlab(SlabHandle(handle.path, other.inode, handle.shape, torch.float32, False))
