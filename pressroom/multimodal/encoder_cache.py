"""The model runner's encoder outputs, keyed by the media's content hash.

An image's embedding rows are computed once and read by every chunked-prefill step its placeholder run spans,
and by any later request with the same image. An entry a running request still needs is pinned; unpinned
entries stay, least recently used first out, while the cache holds at most `capacity_rows` rows."""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pins: dict[str, int] = {}
        self._rows = 0
        self.encoder_runs = 0  # items the encoder computed (a test's count of cache misses)
        self.received = 0  # items whose rows came from another engine (E/P/D's encoder engine), not computed

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        rows = self._entries.get(key)
        if rows is not None:
            self._entries.move_to_end(key)
        return rows

    def put(self, key: str, rows: torch.Tensor) -> None:
        """Rows the encoder just computed here."""
        self.encoder_runs += 1
        self._store(key, rows)

    def receive(self, key: str, rows: torch.Tensor) -> None:
        """Rows another engine's encoder computed (read and checked by a KV connector): cached as if computed
        here, but no encoder run is counted."""
        self.received += 1
        self._store(key, rows)

    def _store(self, key: str, rows: torch.Tensor) -> None:
        if key in self._entries:
            self._rows -= self._entries.pop(key).shape[0]
        self._entries[key] = rows
        self._rows += rows.shape[0]
        self._evict()

    def pin(self, key: str) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
        else:
            self._pins.pop(key, None)
            self._evict()

    def _evict(self) -> None:
        for key in list(self._entries):
            if self._rows <= self.capacity_rows:
                return
            if key not in self._pins:
                self._rows -= self._entries.pop(key).shape[0]
