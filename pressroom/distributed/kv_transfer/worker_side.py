"""A rank's side of a KV connector: copies between its device blocks and the engine's staging buffer, each rank
its own KV heads of the canonical chunk (so engines of any tensor-parallel sizes exchange chunks).

`save_kv`: a finished request's blocks into chunks (a producer, after the step that computed them); `start_load_kv`
and `wait_for_load`: chunks read from another engine into the blocks of a newly admitted request, before the step's
forward pass. The copies themselves are the offload copier's (worker/offload_copier.py), given in by the worker:
the same layout and the same slab mapping."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from pressroom.core.outputs import KVTransfers


class ChunkCopier(Protocol):
    def run(self, caches: list[torch.Tensor], transfers: KVTransfers) -> Any: ...

    def close(self) -> None: ...


class KVConnectorWorker:
    def __init__(self, copier: ChunkCopier) -> None:
        self.copier = copier
        self._event = None

    def save_kv(self, caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """(block, slot) pairs: the blocks' KV into the slots' chunks, done when this returns."""
        event = self.copier.run(caches, KVTransfers(0, saves, []))
        if event is not None:
            event.synchronize()

    def start_load_kv(self, caches: list[torch.Tensor], loads: list[tuple[int, int]]) -> None:
        """(block, slot) pairs: the slots' chunks into the blocks, queued before the step's forward pass."""
        self._event = self.copier.run(caches, KVTransfers(0, [], loads))

    def wait_for_load(self) -> None:
        """Returns once the loads are done (on the CPU at once; on CUDA the copies' event), so the engine may hand
        their slots back."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def close(self) -> None:
        self.copier.close()
