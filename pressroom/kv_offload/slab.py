"""The CPU tier's slab in shared memory: the engine core's process owns it, every worker maps it.

The slab is a memfd (anonymous shared memory, not bounded by /dev/shm's size) that the engine core
creates; a worker, in the same process or in one of its child processes, maps it by its /proc path. On
CUDA each worker page-locks its own mapping (cudaHostRegister), so its copies to and from the device are
asynchronous DMA, as with pinned memory. Ranks on other machines cannot map it: offload needs every rank
of an engine core on the core's machine.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("pressroom")


@dataclass(slots=True, frozen=True)
class SlabHandle:
    """What a worker needs to map the slab: the memfd's path in the owner's /proc, its inode (so a path
    that names another file is refused), and the slab's shape [slots, *chunk_shape] and dtype."""
    path: str
    inode: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    pin: bool  # page-lock the mapping (CUDA workers)

    @property
    def nbytes(self) -> int:
        return max(1, math.prod(self.shape) * self.dtype.itemsize)


def create_slab(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, SlabHandle, int]:
    """A zero-filled slab in a fresh memfd: the owner's view, the handle workers map it by, and the fd
    (kept open while workers may map it)."""
    fd = os.memfd_create("pressroom-kv-slab", os.MFD_CLOEXEC)
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    os.ftruncate(fd, nbytes)
    handle = SlabHandle(f"/proc/{os.getpid()}/fd/{fd}", os.fstat(fd).st_ino, tuple(shape), dtype, pin)
    return _map(f"/proc/self/fd/{fd}", handle), handle, fd


def _map(path: str, handle: SlabHandle) -> torch.Tensor:
    numel = math.prod(handle.shape)
    if numel == 0:
        return torch.empty(handle.shape, dtype=handle.dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=handle.dtype).view(handle.shape)


class MappedSlab:
    """A worker's mapping of the slab, page-locked on CUDA until `close`."""

    def __init__(self, handle: SlabHandle) -> None:
        try:
            inode = os.stat(handle.path).st_ino
        except OSError as e:
            raise ValueError(f"KV offload: the CPU tier's shared memory ({handle.path}) cannot be opened from "
                             f"this process: {e}. Every rank must run on the engine core's machine.") from e
        if inode != handle.inode:
            raise ValueError(f"KV offload: {handle.path} is not the CPU tier's shared memory (another machine's "
                             "process?). Every rank must run on the engine core's machine.")
        self.handle = handle
        self.tensor = _map(handle.path, handle)
        self._registered = handle.pin and self.tensor.numel() > 0 and _register(self.tensor)

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False


def _register(tensor: torch.Tensor) -> bool:
    """Page-locks a mapping for asynchronous device copies; False (copies stay correct, just synchronous)
    if CUDA refuses."""
    rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(rc) != 0:
        logger.warning("KV offload: page-locking the CPU tier (%.1f GiB) failed (CUDA error %d); its copies "
                       "to the device are synchronous", tensor.numel() * tensor.element_size() / 2**30, int(rc))
        return False
    return True
