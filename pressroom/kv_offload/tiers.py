"""Where offloaded chunks live: the primary CPU tier (a slab of chunk slots in host memory, LRU) and secondary
tiers behind it, which hold opaque blobs (header + payload, see layout.py) and work asynchronously.

A secondary tier implements `SecondaryTier`: `lookup` answers from the tier's own index at once; `store`
and `load` start work and return; `poll` hands back what finished since the last call. The filesystem
tier is one; an out-of-tree tier is named by module path and class (`load_tier`).
"""
from __future__ import annotations

import errno
import importlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pressroom.kv_offload.slab import create_slab

logger = logging.getLogger("pressroom")


@dataclass(slots=True)
class TierResult:
    """A finished store or load: `blob` is the bytes loaded (None for a store, or a load that failed)."""
    kind: str  # "store" or "load"
    key: str
    ok: bool
    blob: bytes | None = None
    seconds: float = 0.0
    nbytes: int = 0


class SecondaryTier(ABC):
    """A tier behind the CPU tier. Keys are chunk hashes in hex, blobs are opaque bytes; a tier may drop
    any chunk at any time (a lookup that said yes may be followed by a failed load: the engine computes).
    An out-of-tree tier is built as `cls(fingerprint=<16 bytes>, **options)`: the fingerprint names the
    model and cache layout, for tiers that keep several models apart."""
    kind = "custom"

    @abstractmethod
    def lookup(self, key: str) -> bool:
        """Whether the tier holds the chunk, from its index (no I/O on the engine's loop)."""

    @abstractmethod
    def store(self, key: str, blob: bytes) -> None:
        """Starts writing a chunk; returns at once."""

    @abstractmethod
    def load(self, key: str) -> None:
        """Starts reading a chunk; returns at once."""

    @abstractmethod
    def poll(self) -> list[TierResult]:
        """Stores and loads finished since the last call."""

    def discard(self, key: str) -> None:  # noqa: B027 — optional: a tier may keep what it cannot check
        """Forget a chunk the engine found corrupt (best effort)."""

    def close(self) -> None:  # noqa: B027 — optional: a tier without queued writes has nothing to finish
        """Finish pending writes; called once at shutdown."""


def load_tier(module_path: str, class_name: str, options: dict) -> SecondaryTier:
    """An out-of-tree tier: `module_path.class_name(**options)`."""
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"KV offload tier {module_path}.{class_name} cannot be loaded: {e}") from e
    tier = cls(**options)
    if not isinstance(tier, SecondaryTier):
        raise ValueError(f"KV offload tier {module_path}.{class_name} does not implement "
                         "pressroom.kv_offload.tiers.SecondaryTier.")
    return tier


class _ThreadedTier(SecondaryTier):
    """A tier whose stores and loads run on small thread pools of their own (a load, which a request waits
    for, never queues behind the write-through's backlog), their results queued for `poll`."""

    def __init__(self, threads: int = 2, read_threads: int = 4) -> None:
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix=f"kv-{self.kind}-write")
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix=f"kv-{self.kind}-read")
        self._done: list[TierResult] = []
        self._lock = threading.Lock()

    def store(self, key: str, blob: bytes) -> None:
        self._writers.submit(self._timed, "store", key, self._write, (blob,))

    def store_now(self, key: str, parts: Sequence[bytes | memoryview]) -> None:
        """Writes a chunk given as its parts (header, then a view of the payload) on the caller's thread:
        the engine's write-through hands over views of CPU slots it holds on loan until this returns, so
        the chunk is never copied into a blob. The result is polled as a store's."""
        self._timed("store", key, self._write, parts)

    def load(self, key: str) -> None:
        self._readers.submit(self._timed, "load", key, self._read)

    def poll(self) -> list[TierResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    def _timed(self, kind: str, key: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            blob = fn(key, *args)
            ok = True
        except Exception as e:  # noqa: BLE001 — a failed transfer is a miss, never the engine's error
            blob, ok = None, False
            self._failed(kind, key, e)
        nbytes = len(blob) if blob is not None else (sum(len(p) for p in args[0]) if args else 0)
        with self._lock:
            self._done.append(TierResult(kind, key, ok, blob if kind == "load" else None,
                                         time.perf_counter() - start, nbytes if ok else 0))

    def _failed(self, kind: str, key: str, error: Exception) -> None:
        logger.debug("KV offload %s tier: %s of %s failed: %s", self.kind, kind, key, error)

    @abstractmethod
    def _write(self, key: str, parts: Sequence[bytes | memoryview]) -> None: ...

    @abstractmethod
    def _read(self, key: str) -> bytes: ...


def _read_all(f, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


def _write_all(f, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


# errors that mean the disk cannot take writes at all: the tier turns itself off
_FATAL_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


class FileTier(_ThreadedTier):
    """One file per chunk under `path/<fingerprint>/`, written atomically (a temporary file, then a rename),
    LRU-evicted past `max_bytes`. The index is the directory's listing at start-up (oldest first), so a
    new process finds what an earlier one wrote; it holds only what this tier could have written (see
    `_scan`), and a chunk is never read through a symbolic link. An unwritable path or a full disk turns
    the tier off with one warning; lookups then say no."""
    kind = "fs"
    suffix = ".kv"

    def __init__(self, path: str, fingerprint: bytes, file_bytes: int, max_bytes: int | None = None,
                 threads: int = 2) -> None:
        """`file_bytes`: every chunk file's size (header and payload): a larger file is not ours."""
        super().__init__(threads)
        self.root = Path(path) / fingerprint.hex()
        self.max_bytes, self.file_bytes = max_bytes, file_bytes
        self.enabled = True
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self._index_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._turn_off(f"cannot write to {self.root}: {e}")
            return
        self._scan()

    def _scan(self) -> None:
        """Indexes the chunk files an earlier process left, oldest first, and evicts past the cap at once.
        Only regular files named as ours and no larger than a chunk's file count: a symbolic link (to a
        sparse file of 80 GiB, say) or a stray large file is neither counted against the cap nor ever
        evicted; a shorter one (truncated) is indexed, to be found corrupt when read. A file counts its
        apparent size, as a write counts what it wrote."""
        files = []
        for entry in os.scandir(self.root):
            if self._is_chunk_file(entry):
                st = entry.stat(follow_symlinks=False)
                files.append((st.st_mtime, entry.name[:-len(self.suffix)], st.st_size))
        for _, key, size in sorted(files):
            self._index[key] = size
            self._bytes += size
        for victim in self._over_cap():
            (self.root / (victim + self.suffix)).unlink(missing_ok=True)
        if files:
            logger.info("KV offload fs tier: %d chunks (%.1f MiB) found in %s", len(self._index),
                        self._bytes / 2**20, self.root)

    def _is_chunk_file(self, entry: os.DirEntry) -> bool:
        if not entry.name.endswith(self.suffix) or entry.name.startswith("."):  # "." : a write under way
            return False
        if not entry.is_file(follow_symlinks=False):
            return False
        return entry.stat(follow_symlinks=False).st_size <= self.file_bytes

    def lookup(self, key: str) -> bool:
        with self._index_lock:
            return self.enabled and key in self._index

    def store(self, key: str, blob: bytes) -> None:
        if self._fits(len(blob)):
            super().store(key, blob)

    def store_now(self, key: str, parts: Sequence[bytes | memoryview]) -> None:
        if self._fits(sum(len(p) for p in parts)):
            super().store_now(key, parts)

    def _fits(self, nbytes: int) -> bool:
        return self.enabled and (self.max_bytes is None or nbytes <= self.max_bytes)

    def read_into(self, key: str, header: bytearray, payload: memoryview) -> int:
        """Reads a chunk's header into `header` and its payload straight into `payload` (a CPU slot), for
        the caller to check; returns the payload's length in the file (a short file: the bytes read)."""
        with open(self.root / (key + self.suffix), "rb", buffering=0, opener=_no_follow) as f:
            size = os.fstat(f.fileno()).st_size
            filled = _read_all(f, memoryview(header))
            if filled == len(header):
                filled = _read_all(f, payload)
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)
        return filled if filled < len(payload) else max(0, size - len(header))

    def discard(self, key: str) -> None:
        self._forget(key)
        (self.root / (key + self.suffix)).unlink(missing_ok=True)

    def _write(self, key: str, parts: Sequence[bytes | memoryview]) -> None:
        if not self.enabled:
            raise OSError("the fs tier is off")
        final = self.root / (key + self.suffix)
        tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"  # engines may share the path
        size = sum(len(p) for p in parts)
        try:
            with open(tmp, "wb", buffering=0) as f:
                for part in parts:
                    _write_all(f, part)
            os.replace(tmp, final)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in _FATAL_WRITE_ERRNOS:
                self._turn_off(f"writing {final} failed: {e}")
            raise
        with self._index_lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
            victims = self._over_cap()
        for victim in victims:
            (self.root / (victim + self.suffix)).unlink(missing_ok=True)

    def _over_cap(self) -> list[str]:
        victims = []
        while self.max_bytes is not None and self._bytes > self.max_bytes and self._index:
            victim, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(victim)
        return victims

    def _read(self, key: str) -> bytes:
        with open(self.root / (key + self.suffix), "rb", opener=_no_follow) as f:
            blob = f.read()
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)
        return blob

    def _forget(self, key: str) -> None:
        with self._index_lock:
            self._bytes -= self._index.pop(key, 0)

    def _turn_off(self, why: str) -> None:
        with self._index_lock:  # writer threads may fail together: one warning
            was_on, self.enabled = self.enabled, False
        if was_on:
            logger.warning("KV offload fs tier turned off: %s; requests go on without it", why)


def _no_follow(path: str, flags: int) -> int:
    """Opens a chunk file, never what a symbolic link put in its place points to (ELOOP: read as a miss)."""
    return os.open(path, flags | os.O_NOFOLLOW)


class CPUTier:
    """The primary tier: a slab of chunk-sized slots in shared host memory (slab.py: every worker maps it,
    page-locked on CUDA), least recently used first out. A slot on loan (a step's device copy into or out
    of it not yet done, a write-through still reading it, a load not yet issued) is never reused until
    every loan is returned. Chunks leaving the tier are still in the secondary tiers (written through).
    Thread-safe: promotions from secondary tiers fill slots from worker threads."""

    def __init__(self, max_bytes: int, chunk_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> None:
        self.chunk_bytes = max(1, int(torch.Size(chunk_shape).numel()) * dtype.itemsize)
        self.num_slots = max_bytes // self.chunk_bytes
        self.max_bytes = max_bytes
        # One allocation up front: workers map (and pin) it once, not chunk by chunk on every step.
        self.slab, self.handle, self._fd = create_slab((self.num_slots, *chunk_shape), dtype, pin)
        self._slots: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._loans = [0] * self.num_slots
        self._orphans: set[int] = set()  # slots dropped while on loan: free once the last loan returns
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._slots

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def get(self, key: str) -> torch.Tensor | None:
        """The chunk (a view of its slot), marked as just used; None if the tier does not hold it."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            return self.slab[slot]

    def borrow(self, key: str) -> int | None:
        """The chunk's slot, on loan to the caller until `release`; None if the tier does not hold it."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
                self._loans[slot] += 1
            return slot

    def reserve(self, key: str) -> int | None:
        """A slot for the key's chunk, on loan to the caller, who fills it; the least recently used free
        slot is taken over. None when every slot is on loan: the chunk is not kept."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._free.pop() if self._free else self._evict()
                if slot is None:
                    return None
            self._slots[key] = slot
            self._slots.move_to_end(key)
            self._loans[slot] += 1
            return slot

    def drop(self, key: str) -> None:
        """Forgets a chunk whose slot turned out not to hold it (a promotion that failed its check, a step
        that failed before its copy out of the device was done)."""
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return
            if self._loans[slot]:
                self._orphans.add(slot)
            else:
                self._free.append(slot)

    def borrow_slots(self, slots) -> None:
        """One more loan on slots the caller already holds."""
        with self._lock:
            for slot in slots:
                self._loans[slot] += 1

    def release(self, slots) -> None:
        with self._lock:
            for slot in slots:
                self._loans[slot] -= 1
                if not self._loans[slot] and slot in self._orphans:
                    self._orphans.discard(slot)
                    self._free.append(slot)

    def close(self) -> None:
        """Workers keep their mappings; the fd they opened it by goes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def put(self, key: str, chunk: torch.Tensor) -> bool:
        """Copies a host chunk in; False if no slot is free of loans."""
        slot = self.reserve(key)
        if slot is None:
            return False
        self.slab[slot].copy_(chunk)
        self.release((slot,))
        return True

    def _evict(self) -> int | None:
        for key, slot in self._slots.items():
            if self._loans[slot] == 0:
                del self._slots[key]
                return slot
        return None
