"""The offload tiers and the chunk format on their own: the header catches every kind of damage, the CPU
tier keeps to its byte budget, the filesystem tier to its cap (oldest out) and finds an earlier process's
files, and a chunk still being copied off the device is waited for before the host reads it."""
from __future__ import annotations

import time

import pytest
import torch

from pressroom.config import OffloadConfig, OffloadTierSpec
from pressroom.kv_offload.layout import HEADER_BYTES, CorruptChunk, decode_chunk, encode_chunk
from pressroom.kv_offload.manager import TieredKVStore
from pressroom.kv_offload.tiers import CPUTier, FileTier

SHAPE = (2, 2, 4, 1, 8)
FP, OTHER = b"a" * 16, b"b" * 16


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_a_chunk_round_trips_and_every_damage_is_named():
    c = chunk(0)
    blob = encode_chunk(FP, c)
    assert torch.equal(decode_chunk(FP, blob, torch.float32, SHAPE), c)
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 5] ^= 1
    for bad, reason in ((bytes(flipped), "checksum"), (blob[:-7], "truncated"), (blob[:10], "truncated"),
                        (b"XXXX" + blob[4:], "not a version"), (encode_chunk(OTHER, c), "another model")):
        with pytest.raises(CorruptChunk, match=reason):
            decode_chunk(FP, bad, torch.float32, SHAPE)


def test_the_cpu_tier_keeps_to_its_budget_least_recently_used_out():
    size = chunk(0).numel() * 4
    tier = CPUTier(3 * size)
    for i in range(3):
        tier.put(f"k{i}", chunk(i))
    tier.get("k0")  # used: k1 is now the oldest
    tier.put("k3", chunk(3))
    assert "k1" not in tier and {"k0", "k2", "k3"} <= {k for k in ("k0", "k1", "k2", "k3") if k in tier}
    assert not tier.put("huge", torch.zeros(4 * size))


def _wait(tier: FileTier, n: int) -> list:
    done, deadline = [], time.monotonic() + 10
    while len(done) < n and time.monotonic() < deadline:
        done += tier.poll()
        time.sleep(0.01)
    return done


def test_the_file_tier_caps_its_bytes_and_a_new_process_finds_its_files(tmp_path):
    blob = encode_chunk(FP, chunk(0))
    tier = FileTier(str(tmp_path), FP, max_bytes=2 * len(blob))
    for i in range(3):
        tier.store(f"k{i}", blob)
        assert all(r.ok for r in _wait(tier, 1))
    assert not tier.lookup("k0") and tier.lookup("k1") and tier.lookup("k2")
    assert sorted(p.stem for p in (tmp_path / FP.hex()).glob("*.kv")) == ["k1", "k2"]
    tier.close()
    again = FileTier(str(tmp_path), FP)  # a restart: the index is the directory's listing
    assert again.lookup("k1") and again.lookup("k2") and not again.lookup("k0")
    again.load("k2")
    (result,) = _wait(again, 1)
    assert result.ok and result.blob == blob
    assert not FileTier(str(tmp_path), OTHER).lookup("k1")  # another fingerprint, another directory


class RecordingEvent:
    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def query(self) -> bool:
        return self.waited


def test_a_chunk_still_being_copied_off_the_device_is_waited_for_before_it_is_served():
    store = TieredKVStore(OffloadConfig(1 << 20), FP, SHAPE, torch.float32)
    event = RecordingEvent()
    store.put("k0", chunk(0), event)
    served, waiting = store.lookup(["k0", "k1"])
    assert not waiting and len(served) == 1 and event.waited
    store.close()


def test_promoted_chunks_count_as_hits_of_the_tier_they_came_from(tmp_path):
    config = OffloadConfig(1 << 20, [OffloadTierSpec("fs", str(tmp_path))])
    first = TieredKVStore(config, FP, SHAPE, torch.float32)
    first.put("k0", chunk(0))
    first.close()
    store = TieredKVStore(config, FP, SHAPE, torch.float32)
    served, waiting = store.lookup(["k0"])
    assert served == [] and waiting  # on its way from disk
    deadline = time.monotonic() + 10
    while waiting and time.monotonic() < deadline:
        time.sleep(0.01)
        served, waiting = store.lookup(["k0"])
    assert torch.equal(served[0], chunk(0))
    tiers = store.snapshot().tiers
    assert tiers["1:fs"].chunk_hits == 1 and tiers["0:cpu"].chunk_hits == 0 and tiers["1:fs"].read_bytes > 0
    store.close()
