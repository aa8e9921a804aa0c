"""The offload tiers and the chunk format on their own: the header catches every kind of damage, the CPU
tier keeps to its byte budget and never reuses a slot on loan, the filesystem tier keeps to its cap
(oldest out) and finds an earlier process's files, and a step's slots stay on loan (and its chunks unwritten
to the secondary tiers) until the step's output is back."""
from __future__ import annotations

import time

import pytest
import torch

from pressroom.config import OffloadConfig, OffloadTierSpec
from pressroom.core.outputs import KVTransfers
from pressroom.kv_offload.layout import (
    HEADER_BYTES,
    CorruptChunk,
    checked_payload,
    copy_payload,
    encode_chunk,
    tokens_digest,
)
from pressroom.kv_offload.manager import TieredKVStore
from pressroom.kv_offload.tiers import CPUTier, FileTier

SHAPE = (2, 2, 4, 1, 8)
FP, OTHER = b"a" * 16, b"b" * 16
TOKENS = tokens_digest([1, 2, 3, 4])


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def decode(blob: bytes, key: str = "k0", tokens: bytes | None = TOKENS) -> torch.Tensor:
    out = torch.empty(SHAPE)
    copy_payload(checked_payload(FP, key, blob, out.numel() * 4, tokens), out)
    return out


def test_a_chunk_round_trips_and_every_damage_is_named():
    c = chunk(0)
    blob = encode_chunk(FP, "k0", TOKENS, c)
    assert torch.equal(decode(blob), c) and torch.equal(decode(blob, tokens=None), c)  # a reader without tokens
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 5] ^= 1
    for bad, reason in ((bytes(flipped), "checksum"), (blob[:-7], "truncated"), (blob[:10], "truncated"),
                        (b"XXXX" + blob[4:], "not a version"), (blob[:4] + b"\x03" + blob[5:], "not a version"),
                        (encode_chunk(OTHER, "k0", TOKENS, c), "another model"),
                        (encode_chunk(FP, "k1", TOKENS, c), "another key"),
                        (encode_chunk(FP, "k0", tokens_digest([1, 2, 3, 5]), c), "other token ids")):
        with pytest.raises(CorruptChunk, match=reason):
            decode(bad)


def test_the_cpu_tier_keeps_to_its_budget_least_recently_used_out_and_spares_slots_on_loan():
    size = chunk(0).numel() * 4
    tier = CPUTier(3 * size + size // 2, SHAPE, torch.float32)
    assert tier.num_slots == 3
    for i in range(3):
        assert tier.put(f"k{i}", chunk(i))
    tier.get("k0")  # used: k1 is now the oldest
    tier.put("k3", chunk(3))
    assert "k1" not in tier and all(k in tier for k in ("k0", "k2", "k3"))
    assert torch.equal(tier.get("k2"), chunk(2)) and torch.equal(tier.get("k3"), chunk(3))
    lent = [tier.borrow(k) for k in ("k0", "k2", "k3")]  # e.g. a load not yet copied to the device
    assert not tier.put("k4", chunk(4)) and all(k in tier for k in ("k0", "k2", "k3"))
    tier.release(lent[:1])
    assert tier.put("k4", chunk(4)) and "k0" not in tier and torch.equal(tier.get("k2"), chunk(2))


def _wait(tier: FileTier, n: int) -> list:
    done, deadline = [], time.monotonic() + 10
    while len(done) < n and time.monotonic() < deadline:
        done += tier.poll()
        time.sleep(0.01)
    return done


def test_the_file_tier_caps_its_bytes_and_a_new_process_finds_its_files(tmp_path):
    blob = encode_chunk(FP, "k0", TOKENS, chunk(0))
    tier = FileTier(str(tmp_path), FP, len(blob), max_bytes=2 * len(blob))
    for i in range(3):
        tier.store(f"k{i}", blob)
        assert all(r.ok for r in _wait(tier, 1))
    assert not tier.lookup("k0") and tier.lookup("k1") and tier.lookup("k2")
    assert sorted(p.stem for p in (tmp_path / FP.hex()).glob("*.kv")) == ["k1", "k2"]
    tier.close()
    again = FileTier(str(tmp_path), FP, len(blob))  # a restart: the index is the directory's listing
    assert again.lookup("k1") and again.lookup("k2") and not again.lookup("k0")
    again.load("k2")
    (result,) = _wait(again, 1)
    assert result.ok and result.blob == blob
    assert not FileTier(str(tmp_path), OTHER, len(blob)).lookup("k1")  # another fingerprint, another directory


def test_the_file_tier_indexes_only_its_own_files_and_never_follows_a_link(tmp_path):
    """A symbolic link to a huge sparse file, and a sparse file named as a chunk but not of a chunk's size,
    are neither counted against the cap nor evicted; the link's target is untouched; a chunk file swapped
    for a link after start-up is not read through it."""
    blob = encode_chunk(FP, "k0", TOKENS, chunk(0))
    root, outside = tmp_path / "disk" / FP.hex(), tmp_path / "elsewhere"
    root.mkdir(parents=True)
    outside.mkdir()
    huge = outside / "huge"
    with open(huge, "wb") as f:
        f.truncate(80 << 30)  # 80 GiB apparent, no block written
    (root / "linked.kv").symlink_to(huge)
    with open(root / "sparse.kv", "wb") as f:
        f.truncate(40 << 30)
    (root / "k0.kv").write_bytes(blob)
    tier = FileTier(str(tmp_path / "disk"), FP, len(blob), max_bytes=2 * len(blob))
    assert tier._bytes == len(blob) and list(tier._index) == ["k0"]
    assert not tier.lookup("linked") and not tier.lookup("sparse") and tier.lookup("k0")
    for i in range(1, 4):  # past the cap: only its own files are evicted
        tier.store(f"k{i}", blob)
        assert all(r.ok for r in _wait(tier, 1))
    assert tier._bytes <= 2 * len(blob)
    assert huge.stat().st_size == 80 << 30 and (root / "linked.kv").is_symlink()
    tier.close()

    victim = root / "k3.kv"  # indexed; then swapped for a link to a chunk outside the directory
    (outside / "k3.kv").write_bytes(blob)
    victim.unlink()
    victim.symlink_to(outside / "k3.kv")
    tier = FileTier(str(tmp_path / "disk"), FP, len(blob))
    assert not tier.lookup("k3")
    tier._index["k3"] = len(blob)  # as if indexed before the swap
    tier.load("k3")
    (result,) = _wait(tier, 1)
    assert not result.ok
    with pytest.raises(OSError):
        tier.read_into("k3", bytearray(HEADER_BYTES), memoryview(bytearray(len(blob))))
    assert (outside / "k3.kv").read_bytes() == blob


def store_chunk(store: TieredKVStore, key: str, c: torch.Tensor, finish: bool = True) -> KVTransfers:
    """A step that stores a chunk: the engine reserves its slot, a worker fills it, the step's output comes
    back (`finish`)."""
    transfers = store.start_transfers([(7, key, [1, 2, 3, 4])], [])
    (_, slot), = transfers.stores
    store.cpu.slab[slot].copy_(c)
    if finish:
        store.finish_transfers(transfers)
    return transfers


def test_a_stored_chunk_is_written_through_only_once_its_step_is_done(tmp_path):
    config = OffloadConfig(cpu_bytes=2 * chunk(0).numel() * 4,
                           secondary=[OffloadTierSpec(kind="fs", path=str(tmp_path))])
    store = TieredKVStore(config, FP, SHAPE, torch.float32)
    transfers = store_chunk(store, "k0", chunk(0), finish=False)
    time.sleep(0.05)
    assert not (tmp_path / FP.hex() / "k0.kv").exists()  # the device copy may still be running
    store.finish_transfers(transfers)
    store.finish_transfers(transfers)  # a second call does nothing (the loan is not returned twice)
    store.close()
    assert torch.equal(decode((tmp_path / FP.hex() / "k0.kv").read_bytes()), chunk(0))


def test_slots_are_on_loan_until_their_step_is_done_and_a_lookup_lends_its_slots():
    store = TieredKVStore(OffloadConfig(cpu_bytes=2 * chunk(0).numel() * 4), FP, SHAPE, torch.float32)
    first = store_chunk(store, "k0", chunk(0), finish=False)
    hit = store.lookup(["k0", "k1"])
    assert hit.keys == ["k0"] and hit.missed
    store_chunk(store, "k1", chunk(1))  # its step done: not on loan
    k2 = store.start_transfers([(2, "k2", [2])], [])  # takes k1's slot: k0, though older, is on loan
    assert k2 is not None and "k1" not in store.cpu and "k0" in store.cpu
    assert store.start_transfers([(3, "k3", [3])], []) is None  # k0 and k2 on loan: nothing to take over
    store.release(hit)
    assert store.start_transfers([(3, "k3", [3])], []) is None  # k0's own step is not done
    store.finish_transfers(first)
    assert store.start_transfers([(3, "k3", [3])], []) is not None and "k0" not in store.cpu
    store.count_lookup(hit)
    assert store.snapshot().tiers["0:cpu"].chunk_hits == 1
    assert store.snapshot().total_bytes == {"device_to_cpu": 4 * chunk(0).numel() * 4, "cpu_to_device": 0}
    store.close()


def test_a_failed_steps_stores_are_forgotten_and_its_loans_return():
    store = TieredKVStore(OffloadConfig(cpu_bytes=2 * chunk(0).numel() * 4), FP, SHAPE, torch.float32)
    store_chunk(store, "k0", chunk(0))
    hit = store.lookup(["k0"])
    failed = store.start_transfers([(1, "k1", [1])], [(2, hit.slots[0])])
    store.abandon_transfers(failed)
    assert "k1" not in store.cpu and "k0" in store.cpu  # k1's slot holds nothing known
    assert store.start_transfers([(3, "k2", [3]), (4, "k3", [4])], []) is not None  # both slots free of loans again
    assert list(store.in_flight) == [3]  # only the last step is still out
    store.close()


def test_promoted_chunks_count_as_hits_of_the_tier_they_came_from(tmp_path):
    config = OffloadConfig(cpu_bytes=1 << 20, secondary=[OffloadTierSpec(kind="fs", path=str(tmp_path))])
    first = TieredKVStore(config, FP, SHAPE, torch.float32)
    store_chunk(first, "k0", chunk(0))
    first.close()
    store = TieredKVStore(config, FP, SHAPE, torch.float32)
    hit = store.lookup(["k0"])
    assert hit is None  # on its way from disk
    deadline = time.monotonic() + 10
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.01)
        hit = store.lookup(["k0"])
    assert torch.equal(store.cpu.slab[hit.slots[0]], chunk(0))
    store.count_lookup(hit)
    tiers = store.snapshot().tiers
    assert tiers["1:fs"].chunk_hits == 1 and tiers["0:cpu"].chunk_hits == 0 and tiers["1:fs"].read_bytes > 0
    store.close()


@pytest.mark.parametrize("kind", ["fs", "module"])
def test_a_promoted_chunk_of_other_token_ids_is_corrupt(kind, tmp_path):
    """A chunk read from a secondary tier must hold the token ids of the lookup's block (the chunk's key is
    checked too; the tokens' own digest does not lean on the key's chaining): one that does not is counted
    corrupt and not served; the right tokens find it."""
    spec = (OffloadTierSpec(kind="fs", path=str(tmp_path)) if kind == "fs" else
            OffloadTierSpec(kind="module", module_path="memory_tier", class_name="MemoryTier",
                            options={"name": f"tokens-{tmp_path.name}"}))
    config = OffloadConfig(cpu_bytes=1 << 20, secondary=[spec])
    first = TieredKVStore(config, FP, SHAPE, torch.float32)
    store_chunk(first, "k0", chunk(0))  # stored with the tokens [1, 2, 3, 4]
    first.close()
    if kind == "module":  # its stores finish on threads of their own
        import memory_tier
        deadline = time.monotonic() + 10
        while "k0" not in memory_tier.STORES[spec.options["name"]]:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def settled(store: TieredKVStore, tokens: list[int]):
        deadline = time.monotonic() + 10
        while (hit := store.lookup(["k0"], lambda i: tokens)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return hit

    store = TieredKVStore(config, FP, SHAPE, torch.float32)
    hit = settled(store, [1, 2, 3, 5])
    assert not hit.keys and store.snapshot().tiers["1:fs" if kind == "fs" else "1:memory"].corrupt_chunks == 1
    store.close()
    if kind == "module":  # the memory tier forgets nothing: the same chunk, asked for with the right tokens
        store = TieredKVStore(config, FP, SHAPE, torch.float32)
        hit = settled(store, [1, 2, 3, 4])
        assert hit.keys == ["k0"] and torch.equal(store.cpu.slab[hit.slots[0]], chunk(0))
        store.close()
