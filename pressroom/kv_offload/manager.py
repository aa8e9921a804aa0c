"""The tier chain the block pool consults: the CPU tier first, then the secondary tiers in order.

`TieredKVStore` lives beside the scheduler, in the engine core's process: the scheduler asks it which
chunks of a prompt it holds (`lookup`, which lends their CPU slots), and each step's copies get their
slots here (`start_transfers`: slots reserved for blocks leaving the device, lent slots to copy in). The
workers, in this process or their own, copy their KV heads between the device and the shared slab
(slab.py) before the step's forward pass; when the step's output is back, every rank's copies are done
and the slots' loans return (`finish_transfers`). `poll`, once a step, collects finished work. Every
chunk read from a secondary tier is checked (layout.py) on a worker thread before the CPU tier takes it;
a bad one is dropped, counted and recomputed. The file tier's chunks move without copies:
written from the CPU slot they sit in, read straight into the slot they will be served from.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pressroom.config import OffloadConfig
from pressroom.core.outputs import KVTransfers
from pressroom.kv_offload.layout import (
    HEADER_BYTES,
    CorruptChunk,
    check_header,
    check_payload,
    checked_payload,
    chunk_parts,
    copy_payload,
    payload_view,
    tokens_digest,
)
from pressroom.kv_offload.tiers import CPUTier, FileTier, SecondaryTier, TierResult, _ThreadedTier, load_tier

logger = logging.getLogger("pressroom")

TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class Histogram:
    """Cumulative-ready bucket counts (per bucket, not cumulative), their sum and count."""
    buckets: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        i = next((i for i, bound in enumerate(TIME_BUCKETS) if value <= bound), len(TIME_BUCKETS))
        self.buckets[i] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True)
class OffloadHit:
    """What the tiers hold of a prompt past its device hits: the leading chunks, their CPU slots (on loan
    until the device has them, or until `TieredKVStore.release`), and whether the run ended before the
    prompt's last full block."""
    keys: list[str]
    slots: list[int]
    missed: bool

    def __len__(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class TierStats:
    chunk_queries: int = 0
    chunk_hits: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_time: Histogram = field(default_factory=Histogram)
    write_time: Histogram = field(default_factory=Histogram)
    corrupt_chunks: int = 0  # read but not served: truncated, corrupt, another model's or another key's
    failed_jobs: int = 0  # stores or loads that did not complete


@dataclass(slots=True)
class OffloadStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)  # by "index:kind", "0:cpu" first
    total_bytes: dict[str, int] = field(default_factory=dict)  # by transfer type: device_to_cpu, cpu_to_device


class TieredKVStore:
    def __init__(self, config: OffloadConfig, fingerprint: bytes, chunk_shape: tuple[int, ...],
                 dtype: torch.dtype, pin: bool = False) -> None:
        """`pin`: the workers page-lock their mappings of the CPU tier (CUDA)."""
        self.fingerprint, self.chunk_shape, self.dtype = fingerprint, tuple(chunk_shape), dtype
        self.cpu = CPUTier(config.cpu_bytes, self.chunk_shape, dtype, pin)
        self.chunk_bytes = self.cpu.chunk_bytes
        self.secondary: list[SecondaryTier] = [self._make_tier(spec) for spec in config.secondary]
        self.labels = ["0:cpu"] + [f"{i + 1}:{t.kind}" for i, t in enumerate(self.secondary)]
        self.stats = OffloadStats({label: TierStats() for label in self.labels},
                                  {"device_to_cpu": 0, "cpu_to_device": 0})
        self._loading: dict[str, int] = {}  # key -> secondary tier reading it (until checked and in a slot)
        self._loading_tokens: dict[str, bytes | None] = {}  # key -> its block's tokens_digest, if the reader knew it
        self._origin: dict[str, int] = {}  # key -> tier a promoted chunk came from (for its hit count)
        self._unreadable: set[str] = set()  # chunks a tier said it had but could not serve
        self._cascade = ThreadPoolExecutor(2, thread_name_prefix="kv-cascade")
        # Checksums of promoted chunks run here, off the engine's loop (zlib lets go of the GIL).
        self._checker = ThreadPoolExecutor(4, thread_name_prefix="kv-check") if self.secondary else None
        self._checked: list[tuple[int, TierResult, str | None, bool]] = []  # tier, result, error, kept
        self._lock = threading.Lock()  # the worker threads and the engine loop both count
        self._warned: set[str] = set()
        self._step = 0
        # step -> stored keys, their tokens_digests, their slots; lent slots
        self.in_flight: dict[int, tuple[list[str], list[bytes], list[int], list[int]]] = {}
        self._closed = False

    def _make_tier(self, spec) -> SecondaryTier:
        if spec.kind == "fs":
            return FileTier(spec.path, self.fingerprint, HEADER_BYTES + self.chunk_bytes, spec.max_bytes)
        return load_tier(spec.module_path, spec.class_name, {**spec.options, "fingerprint": self.fingerprint})

    # ---- the scheduler's side ----

    def lookup(self, keys: list[str], block_tokens: Callable[[int], Sequence[int]] | None = None
               ) -> OffloadHit | None:
        """The leading run of `keys` the CPU tier holds, their slots lent to the caller; or None when the
        run goes on in a secondary tier: those chunks are being read into the CPU tier and the caller
        should ask again later instead of computing them. `block_tokens(i)`: the token ids of `keys[i]`'s
        block, which a chunk read from a secondary tier must have been stored with."""
        self.poll()
        served: list[str] = []
        slots: list[int] = []
        for key in keys:
            slot = None if key in self._loading else self.cpu.borrow(key)  # a promotion still being checked
            if slot is None:
                break
            served.append(key)
            slots.append(slot)
        if self._start_loads(keys, len(served), block_tokens):
            self.cpu.release(slots)
            return None
        return OffloadHit(served, slots, len(served) < len(keys))

    def release(self, hit: OffloadHit) -> None:
        """Returns the slots of a lookup whose request was not admitted."""
        self.cpu.release(hit.slots)

    def _start_loads(self, keys: list[str], first: int, block_tokens: Callable[[int], Sequence[int]] | None
                     ) -> bool:
        """Reads the leading run of `keys[first:]` that secondary tiers hold into the CPU tier; True if any
        is on its way."""
        waiting = False
        room = max(1, self.cpu.num_slots // 2)  # promoted chunks must fit to be served
        for i in range(first, min(len(keys), first + room)):
            key = keys[i]
            if key in self._loading:
                waiting = True
                continue
            if key in self.cpu:  # already servable (and its slot perhaps lent): not read again
                continue
            if self._origin.pop(key, None) is not None:  # promoted, then pushed out before it was served:
                break  # computed this time (no second wait); a later request may read it again
            tier = self._holder(key)
            if tier is None:
                break
            self._loading[key] = tier
            self._loading_tokens[key] = None if block_tokens is None else tokens_digest(block_tokens(i))
            if isinstance(self.secondary[tier], FileTier):
                self._checker.submit(self._promote_file, tier, key)
            else:
                self.secondary[tier].load(key)
            waiting = True
        return waiting

    def _holder(self, key: str) -> int | None:
        if key in self._unreadable:
            return None
        return next((i for i, t in enumerate(self.secondary) if t.lookup(key)), None)

    def count_lookup(self, hit: OffloadHit) -> None:
        """Per tier: chunks asked of it and found in it, counted once per admitted request. A promoted
        chunk counts where it was found."""
        tiers = self.stats.tiers
        with self._lock:
            for key in hit.keys:
                origin = self._origin.pop(key, -1) + 1  # 0: the CPU tier
                for i in range(origin + 1):
                    tiers[self.labels[i]].chunk_queries += 1
                tiers[self.labels[origin]].chunk_hits += 1
            if hit.missed:  # the chunk that ended the run was asked of every tier
                for label in self.labels:
                    tiers[label].chunk_queries += 1

    def holds(self, key: str) -> bool:
        """Whether some tier has (or is about to have) the chunk: storing it again would be waste."""
        return key in self.cpu or key in self._loading or self._holder(key) is not None

    # ---- one step's copies ----

    def start_transfers(self, stores: list[tuple[int, str, Sequence[int]]], loads: list[tuple[int, int]]
                        ) -> KVTransfers | None:
        """The copies the next step makes: `stores` (device block, chunk key, the block's token ids) get CPU
        slots reserved here (a chunk with no slot free of loans is not kept); `loads` (device block, slot)
        come with slots a lookup lent. Every slot stays on loan until `finish_transfers` (the step's output is
        back: every rank's copies are done) or `abandon_transfers` (the step failed)."""
        reserved = [(block, key, tokens, self.cpu.reserve(key)) for block, key, tokens in stores]
        reserved = [r for r in reserved if r[3] is not None]
        if not reserved and not loads:
            return None
        self._step += 1
        transfers = KVTransfers(self._step, [(block, slot) for block, _, _, slot in reserved], list(loads))
        keys = [key for _, key, _, _ in reserved]
        digests = [tokens_digest(tokens) for _, _, tokens, _ in reserved]
        self.in_flight[self._step] = (keys, digests, [s for _, s in transfers.stores], [s for _, s in loads])
        for key in keys:
            self._unreadable.discard(key)
            self._origin.pop(key, None)
        with self._lock:
            self.stats.total_bytes["device_to_cpu"] += len(keys) * self.chunk_bytes
            self.stats.total_bytes["cpu_to_device"] += len(loads) * self.chunk_bytes
        return transfers

    def finish_transfers(self, transfers: KVTransfers) -> None:
        """A step's copies are done: its loads' slots go back, its stored chunks are servable and go on to
        the secondary tiers in the background. Once per step; a second call does nothing."""
        entry = self.in_flight.pop(transfers.step, None)
        if entry is None:
            return
        keys, digests, stored, lent = entry
        self.cpu.release(lent)
        if self.secondary:
            for key, tokens, slot in zip(keys, digests, stored):  # the reservation's loan passes to the write-through
                self._cascade.submit(self._write_through, key, tokens, slot)
        else:
            self.cpu.release(stored)

    def abandon_transfers(self, transfers: KVTransfers) -> None:
        """A step failed: its copies may not have run. Its stored chunks are forgotten (their slots hold
        nothing known), its loads' slots go back."""
        entry = self.in_flight.pop(transfers.step, None)
        if entry is None:
            return
        keys, _, stored, lent = entry
        self.cpu.release(lent)
        for key in keys:
            self.cpu.drop(key)
        self.cpu.release(stored)

    def _write_through(self, key: str, tokens: bytes, slot: int) -> None:
        """On a cascade thread: the chunk goes from its slot (on loan until here is done) to every secondary
        tier; threaded tiers write the slot's own bytes, others get a blob."""
        try:
            parts = chunk_parts(self.fingerprint, key, tokens, self.cpu.slab[slot])
            blob = None
            for tier in self.secondary:
                if isinstance(tier, _ThreadedTier):
                    tier.store_now(key, parts)
                else:
                    blob = blob or parts[0] + parts[1].tobytes()
                    tier.store(key, blob)
        finally:
            self.cpu.release((slot,))

    # ---- housekeeping ----

    def poll(self) -> None:
        """Takes in finished work: chunks the secondary tiers loaded go to be checked, and checked ones
        become servable."""
        for i, tier in enumerate(self.secondary):
            for result in tier.poll():
                self._take(i, result)
        with self._lock:
            checked, self._checked = self._checked, []
        for i, result, error, kept in checked:
            self._admit_checked(i, result, error, kept)

    def _take(self, i: int, result: TierResult) -> None:
        stats = self.stats.tiers[self.labels[i + 1]]
        if result.kind == "store":
            with self._lock:
                if result.ok:
                    stats.write_bytes += result.nbytes
                    stats.write_time.observe(result.seconds)
                else:
                    stats.failed_jobs += 1
            return
        if not result.ok or result.blob is None:  # e.g. the file went away after the lookup
            self._load_failed(i, result.key)
            return
        if self._closed:  # loads finished at shutdown serve no one
            self._done_loading(result.key)
            return
        self._checker.submit(self._check, i, result)

    def _check(self, i: int, result: TierResult) -> None:
        """On a checker thread: verifies a loaded blob and copies it into a CPU slot."""
        error, kept = None, False
        try:
            payload = checked_payload(self.fingerprint, result.key, result.blob, self.chunk_bytes,
                                      self._loading_tokens.get(result.key))
            slot = self.cpu.reserve(result.key)
            if slot is not None:
                try:
                    copy_payload(payload, self.cpu.slab[slot])
                finally:
                    self.cpu.release((slot,))
                kept = True
        except CorruptChunk as e:
            error = str(e)
        with self._lock:
            self._checked.append((i, result, error, kept))

    def _promote_file(self, i: int, key: str) -> None:
        """On a checker thread: reads a file tier's chunk straight into a reserved CPU slot and checks it
        there; a chunk that fails leaves the slot empty."""
        start = time.perf_counter()
        error, kept, ok, nbytes = None, False, True, 0
        slot = self.cpu.reserve(key)
        if slot is not None:
            header = bytearray(HEADER_BYTES)
            payload = payload_view(self.cpu.slab[slot])
            try:
                length = self.secondary[i].read_into(key, header, payload)
                check_payload(payload, check_header(self.fingerprint, key, header, length, self.chunk_bytes,
                                                    self._loading_tokens.get(key)))
                kept, nbytes = True, HEADER_BYTES + length
            except CorruptChunk as e:
                error = str(e)
            except OSError:  # e.g. the file went away after the lookup
                ok = False
            finally:
                if not kept:
                    self.cpu.drop(key)
                self.cpu.release((slot,))
        result = TierResult("load", key, ok, None, time.perf_counter() - start, nbytes)
        with self._lock:
            self._checked.append((i, result, error, kept))

    def _done_loading(self, key: str) -> None:
        self._loading.pop(key, None)
        self._loading_tokens.pop(key, None)

    def _load_failed(self, i: int, key: str) -> None:
        self._done_loading(key)
        self.stats.tiers[self.labels[i + 1]].failed_jobs += 1
        self._unreadable.add(key)
        self.secondary[i].discard(key)

    def _admit_checked(self, i: int, result: TierResult, error: str | None, kept: bool) -> None:
        if not result.ok:
            self._load_failed(i, result.key)
            return
        self._done_loading(result.key)
        label = self.labels[i + 1]
        stats = self.stats.tiers[label]
        if error is not None:
            stats.corrupt_chunks += 1
            self._unreadable.add(result.key)
            self.secondary[i].discard(result.key)
            if label not in self._warned:
                self._warned.add(label)
                logger.warning("KV offload tier %s: chunk %s not served (%s); its tokens are recomputed "
                               "(warned once per tier; counted in kv_offload_tiering_corrupt_chunks)",
                               label, result.key, error)
            return
        stats.read_bytes += result.nbytes
        stats.read_time.observe(result.seconds)
        if kept:
            self._origin[result.key] = i

    def snapshot(self) -> OffloadStats:
        with self._lock:
            return OffloadStats({k: TierStats(v.chunk_queries, v.chunk_hits, v.read_bytes, v.write_bytes,
                                              Histogram(list(v.read_time.buckets), v.read_time.total,
                                                        v.read_time.count),
                                              Histogram(list(v.write_time.buckets), v.write_time.total,
                                                        v.write_time.count),
                                              v.corrupt_chunks, v.failed_jobs)
                                 for k, v in self.stats.tiers.items()}, dict(self.stats.total_bytes))

    def close(self) -> None:
        """Finishes the writes still queued (a restart finds them), then closes the tiers."""
        self._cascade.shutdown(wait=True)
        for tier in self.secondary:
            tier.close()
        if self._checker is not None:
            self._checker.shutdown(wait=True)
        self._closed = True
        self.poll()
        self.cpu.close()
