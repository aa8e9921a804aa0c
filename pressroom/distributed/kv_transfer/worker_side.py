"""A rank's side of a KV connector: copies between its device blocks and the engine's staging buffer, each rank
its own KV heads of the canonical chunk (so engines of any tensor-parallel sizes exchange chunks).

`save_kv`: a finished request's blocks into chunks (a producer, after the step that computed them); `start_load_kv`
and `wait_for_load`: chunks read from another engine into the blocks of a newly admitted request, before the step's
forward pass. The copies themselves are the offload copier's (worker/offload_copier.py), given in by the worker:
the same layout and the same slab mapping.

E/P/D: `media_shapes`, `save_media` and `load_media` move an encoder cache's rows (one media item's embeddings,
keyed by its content hash) between the runner's encoder cache and staging chunks, as raw bytes split over as many
chunks as they need (the last one zero-padded)."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from pressroom.core.outputs import KVTransfers


class ChunkCopier(Protocol):
    def run(self, caches: list[torch.Tensor], transfers: KVTransfers) -> Any: ...

    def close(self) -> None: ...


class MediaCache(Protocol):
    """The runner's encoder cache (multimodal/encoder_cache.py), as the connector uses it."""
    encoder_runs: int

    def get(self, key: str) -> torch.Tensor | None: ...

    def receive(self, key: str, rows: torch.Tensor) -> None: ...


class KVConnectorWorker:
    def __init__(self, copier: ChunkCopier, slab: torch.Tensor | None = None) -> None:
        """`slab`: the whole staging buffer as mapped here ([slots, *chunk]), for media rows' raw bytes."""
        self.copier = copier
        self._event = None
        self._bytes = slab.view(-1).view(torch.uint8).view(slab.shape[0], -1) if slab is not None else None

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

    # ---- E/P/D: encoder outputs ----

    @staticmethod
    def media_shapes(cache: MediaCache | None, keys: list[str]) -> list[tuple[tuple[int, ...], str] | None]:
        """Each key's cached rows' (shape, dtype name), or None where the cache lacks them (evicted)."""
        out = []
        for key in keys:
            rows = cache.get(key) if cache is not None else None
            out.append(None if rows is None else (tuple(rows.shape), str(rows.dtype).removeprefix("torch.")))
        return out

    def save_media(self, cache: MediaCache, saves: list[tuple[str, list[int]]]) -> None:
        """(key, slots): the cached rows' bytes into the slots, in order, the last one zero-padded."""
        for key, slots in saves:
            data = cache.get(key).detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            for k, slot in enumerate(slots):
                part = data[k * self._bytes.shape[1]:(k + 1) * self._bytes.shape[1]]
                self._bytes[slot, :part.numel()].copy_(part)
                self._bytes[slot, part.numel():].zero_()

    def load_media(self, cache: MediaCache, loads: list[tuple[str, list[int], tuple[int, ...], str]],
                   device: torch.device | str) -> None:
        """(key, slots, shape, dtype): rows read from another engine's staging into the encoder cache (no encoder
        run counted)."""
        for key, slots, shape, dtype in loads:
            data = self._bytes[slots].reshape(-1)
            torch_dtype = getattr(torch, dtype)
            nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
            rows = data[:nbytes].clone().view(torch_dtype).view(shape)
            cache.receive(key, rows.to(device))

    def close(self) -> None:
        self.copier.close()
