"""The staging buffer: host memory holding whole chunks (one KV block over every layer and KV head, in
kv_offload/layout.py's canonical head-major layout) beside their checked headers.

A producer's ranks copy a finished request's blocks into chunks here and the engine core writes each chunk's header
(model fingerprint, key, token ids' digest, length, XXH3 checksum); a consumer engine reads headers and chunks into
its own buffer through the transport, checks them, and its ranks copy them into its blocks. The chunks are a memfd
slab (kv_offload/slab.py) that every rank maps, so the copies are the ranks' and the transport sees one region per
engine whatever its tensor-parallel size."""
from __future__ import annotations

import math
import os

import torch

from pressroom.kv_offload.layout import HEADER_BYTES, chunk_parts, payload_view
from pressroom.kv_offload.slab import SlabHandle, create_slab


class StagingBuffer:
    def __init__(self, nbytes: int, chunk_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.chunk_bytes = math.prod(chunk_shape) * dtype.itemsize
        self.num_slots = nbytes // (self.chunk_bytes + HEADER_BYTES)
        if self.num_slots < 1:
            raise ValueError(f"kv_buffer_size {nbytes} holds no chunk of {self.chunk_bytes} bytes; raise it.")
        self.chunks, self.handle, self._fd = create_slab((self.num_slots, *chunk_shape), dtype, pin)
        self.headers = torch.zeros((self.num_slots, HEADER_BYTES), dtype=torch.uint8)
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def slab_handle(self) -> SlabHandle:
        return self.handle

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n slots, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def chunk_address(self, slot: int) -> int:
        return self.chunks.data_ptr() + slot * self.chunk_bytes

    def header_address(self, slot: int) -> int:
        return self.headers.data_ptr() + slot * HEADER_BYTES

    def seal(self, slot: int, fingerprint: bytes, key: str, tokens: bytes) -> None:
        """Writes the header of the chunk the ranks copied into `slot`."""
        header, _ = chunk_parts(fingerprint, key, tokens, self.chunks[slot])
        self.headers[slot].numpy()[:] = memoryview(header)

    def header(self, slot: int) -> memoryview:
        return memoryview(self.headers[slot].numpy())

    def payload(self, slot: int) -> memoryview:
        return payload_view(self.chunks[slot])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
