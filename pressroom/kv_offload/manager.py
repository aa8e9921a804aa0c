"""The tier chain the block pool consults: the CPU tier first, then the secondary tiers in order.

`TieredKVStore` lives beside the scheduler (in the engine core's process, with the worker in it): the
scheduler asks it which chunks of a prompt it holds (`lookup`), the model runner hands it the blocks it
copied out of the device cache (`put`) and reads chunks back in, and `poll`, once a step, collects the
secondary tiers' finished work. Every chunk read from a secondary tier is checked (layout.py) before the
CPU tier takes it; a bad one is dropped, counted and recomputed.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pressroom.config import OffloadConfig
from pressroom.kv_offload.layout import CorruptChunk, decode_chunk, encode_chunk
from pressroom.kv_offload.tiers import CPUTier, FileTier, SecondaryTier, TierResult, load_tier

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
class TierStats:
    chunk_queries: int = 0
    chunk_hits: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_time: Histogram = field(default_factory=Histogram)
    write_time: Histogram = field(default_factory=Histogram)
    corrupt_chunks: int = 0  # read but not served: truncated, corrupt or another model's
    failed_jobs: int = 0  # stores or loads that did not complete


@dataclass(slots=True)
class OffloadStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)  # by "index:kind", "0:cpu" first
    total_bytes: dict[str, int] = field(default_factory=dict)  # by transfer type: device_to_cpu, cpu_to_device


class TieredKVStore:
    def __init__(self, config: OffloadConfig, fingerprint: bytes, chunk_shape: tuple[int, ...],
                 dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.fingerprint, self.chunk_shape, self.dtype = fingerprint, tuple(chunk_shape), dtype
        self.pin_memory = pin_memory
        self.chunk_bytes = max(1, int(torch.Size(chunk_shape).numel()) * dtype.itemsize)
        self.cpu = CPUTier(config.cpu_bytes)
        self.secondary: list[SecondaryTier] = [self._make_tier(spec) for spec in config.secondary]
        self.labels = ["0:cpu"] + [f"{i + 1}:{t.kind}" for i, t in enumerate(self.secondary)]
        self.stats = OffloadStats({label: TierStats() for label in self.labels},
                                  {"device_to_cpu": 0, "cpu_to_device": 0})
        self._loading: dict[str, int] = {}  # key -> secondary tier index reading it
        self._origin: dict[str, int] = {}  # key -> tier a promoted chunk came from (for its hit count)
        self._unreadable: set[str] = set()  # chunks a tier said it had but could not serve
        self._cascade = ThreadPoolExecutor(1, thread_name_prefix="kv-cascade")
        self._lock = threading.Lock()  # the cascade thread and the engine loop both count
        self._warned: set[str] = set()
        self._in_flight: dict[str, object] = {}  # key -> the CUDA event its device-to-host copy completes

    def _make_tier(self, spec) -> SecondaryTier:
        if spec.kind == "fs":
            return FileTier(spec.path, self.fingerprint, spec.max_bytes)
        return load_tier(spec.module_path, spec.class_name, {**spec.options, "fingerprint": self.fingerprint})

    # ---- the scheduler's side ----

    def lookup(self, keys: list[str]) -> tuple[list[torch.Tensor], bool]:
        """The chunks of the leading run of `keys` the CPU tier holds, and whether the run goes on in a
        secondary tier: then those chunks are being read into the CPU tier and the caller should ask again
        later (True) instead of computing them."""
        self.poll()
        ready: list[torch.Tensor] = []
        for key in keys:
            chunk = self.cpu.get(key)
            if chunk is None:
                break
            copied = self._in_flight.pop(key, None)
            if copied is not None:  # its copy out of the device may still be running: host reads wait for it
                copied.synchronize()
            ready.append(chunk)
        rest = keys[len(ready):]
        if self._start_loads(rest):
            return ready, True
        self._count_lookup(keys[:len(ready)], missed=bool(rest))
        return ready, False

    def _start_loads(self, keys: list[str]) -> bool:
        """Reads the leading run of `keys` that secondary tiers hold into the CPU tier; True if any is on
        its way."""
        waiting = False
        room = max(1, self.cpu.max_bytes // self.chunk_bytes // 2)  # promoted chunks must fit to be served
        for key in keys[:room]:
            if key in self._loading:
                waiting = True
                continue
            if self._origin.pop(key, None) is not None:  # promoted, then pushed out before it was served:
                break  # computed this time (no second wait); a later request may read it again
            tier = self._holder(key)
            if tier is None:
                break
            self._loading[key] = tier
            self.secondary[tier].load(key)
            waiting = True
        return waiting

    def _holder(self, key: str) -> int | None:
        if key in self._unreadable:
            return None
        return next((i for i, t in enumerate(self.secondary) if t.lookup(key)), None)

    def _count_lookup(self, served: list[str], missed: bool) -> None:
        """Per tier: chunks asked of it and found in it. A promoted chunk counts where it was found."""
        tiers = self.stats.tiers
        for key in served:
            origin = self._origin.pop(key, -1) + 1  # 0: the CPU tier
            for i in range(origin + 1):
                tiers[self.labels[i]].chunk_queries += 1
            tiers[self.labels[origin]].chunk_hits += 1
        if missed:  # the chunk that ended the run was asked of every tier
            for label in self.labels:
                tiers[label].chunk_queries += 1

    def holds(self, key: str) -> bool:
        """Whether some tier has (or is about to have) the chunk: storing it again would be waste."""
        return key in self.cpu or key in self._loading or self._holder(key) is not None

    # ---- the model runner's side ----

    def put(self, key: str, chunk: torch.Tensor, ready: object | None = None) -> None:
        """A chunk copied out of the device cache (`ready`: the copy's CUDA event, if it is still in
        flight). The CPU tier takes it; the secondary tiers get it in the background."""
        self.cpu.put(key, chunk)
        self._unreadable.discard(key)
        self._origin.pop(key, None)
        if ready is not None:
            self._in_flight[key] = ready
        if self.secondary:
            self._cascade.submit(self._write_through, key, chunk, ready)

    def count_device_transfer(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.stats.total_bytes[kind] += nbytes

    def _write_through(self, key: str, chunk: torch.Tensor, ready: object | None) -> None:
        if ready is not None:
            ready.synchronize()
        blob = encode_chunk(self.fingerprint, chunk)
        for tier in self.secondary:
            tier.store(key, blob)

    # ---- housekeeping ----

    def poll(self) -> None:
        """Takes in the secondary tiers' finished work: loaded chunks are checked and go to the CPU tier.
        Device copies that have completed are forgotten."""
        if self._in_flight:
            self._in_flight = {k: e for k, e in self._in_flight.items() if not e.query()}
        for i, tier in enumerate(self.secondary):
            for result in tier.poll():
                self._take(i, tier, result)

    def _take(self, i: int, tier: SecondaryTier, result: TierResult) -> None:
        stats = self.stats.tiers[self.labels[i + 1]]
        if result.kind == "store":
            with self._lock:
                if result.ok:
                    stats.write_bytes += result.nbytes
                    stats.write_time.observe(result.seconds)
                else:
                    stats.failed_jobs += 1
            return
        self._loading.pop(result.key, None)
        if not result.ok or result.blob is None:  # e.g. the file went away after the lookup
            stats.failed_jobs += 1
            self._unreadable.add(result.key)
            tier.discard(result.key)
            return
        try:
            chunk = decode_chunk(self.fingerprint, result.blob, self.dtype, self.chunk_shape)
        except CorruptChunk as e:
            stats.corrupt_chunks += 1
            self._unreadable.add(result.key)
            tier.discard(result.key)
            if self.labels[i + 1] not in self._warned:
                self._warned.add(self.labels[i + 1])
                logger.warning("KV offload tier %s: chunk %s not served (%s); its tokens are recomputed "
                               "(warned once per tier; counted in kv_offload_tiering_corrupt_chunks)",
                               self.labels[i + 1], result.key, e)
            return
        stats.read_bytes += result.nbytes
        stats.read_time.observe(result.seconds)
        if self.pin_memory:
            chunk = chunk.pin_memory()
        if self.cpu.put(result.key, chunk):
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
        self.poll()
