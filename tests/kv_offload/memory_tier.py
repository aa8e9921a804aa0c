"""An out-of-tree KV offload tier for the tests, loaded by module path: chunks in a dict, stores and loads
finished by a thread of its own, as a remote store's would be."""
from __future__ import annotations

import threading
import time

from pressroom.kv_offload.tiers import SecondaryTier, TierResult

STORES: dict[str, dict[str, bytes]] = {}  # by name: what each tier holds, for the tests to look into


class MemoryTier(SecondaryTier):
    kind = "memory"

    def __init__(self, fingerprint: bytes, name: str = "default") -> None:
        self.chunks = STORES.setdefault(name, {})
        self.fingerprint = fingerprint
        self._done: list[TierResult] = []
        self._lock = threading.Lock()

    def lookup(self, key: str) -> bool:
        return key in self.chunks

    def store(self, key: str, blob: bytes) -> None:
        threading.Thread(target=self._finish, args=("store", key, blob)).start()

    def load(self, key: str) -> None:
        threading.Thread(target=self._finish, args=("load", key, None)).start()

    def poll(self) -> list[TierResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _finish(self, kind: str, key: str, blob: bytes | None) -> None:
        time.sleep(0.001)
        if kind == "store":
            self.chunks[key] = blob
            result = TierResult("store", key, True, None, 0.001, len(blob))
        else:
            data = self.chunks.get(key)
            result = TierResult("load", key, data is not None, data, 0.001, len(data or b""))
        with self._lock:
            self._done.append(result)
