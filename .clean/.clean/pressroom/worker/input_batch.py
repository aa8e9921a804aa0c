"""The model runner's persistent input batch: one step's flat inputs in host buffers allocated once.

Every step lays out its token ids, positions, KV slots, context lengths, query starts and block tables
back to back in one host byte buffer (pinned on CUDA), filled through numpy views, and sends them to
the device's mirror of that buffer in one non-blocking copy; the step's tensors are views of the
mirror. On the CPU the host buffer is the device's, and nothing is copied.

The next step refills the same buffers, so a step's input tensors are valid until the next `begin`;
on CUDA `begin` first waits for the previous step's copy to leave the host buffer (only the copy,
queued at the start of that step, never its forward pass).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 64  # bytes: every field starts on a cache line (and a 16-byte boundary, as Triton likes)


@dataclass(slots=True)
class StepArrays:
    """Numpy views of one step's fields in the host buffer, for the runner to fill."""
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]
    seq_lens: np.ndarray  # index dtype [reqs]
    query_start_loc: np.ndarray  # int32 [reqs + 1]
    block_tables: np.ndarray  # index dtype [reqs, width], contiguous


@dataclass(slots=True)
class StepTensors:
    """The same fields on the device (views of the mirror), valid until the next step's `begin`."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor


def _fields(num_tokens: int, num_reqs: int, width: int, index: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    return [("input_ids", torch.int64, num_tokens), ("positions", torch.int64, num_tokens),
            ("slot_mapping", torch.int64, num_tokens), ("seq_lens", index, num_reqs),
            ("query_start_loc", torch.int32, num_reqs + 1), ("block_tables", index, num_reqs * width)]


def _layout(num_tokens: int, num_reqs: int, width: int, index: torch.dtype
            ) -> tuple[list[tuple[str, torch.dtype, int, int]], int]:
    """(name, dtype, elements, byte offset) of each field, and the bytes of them all."""
    out, offset = [], 0
    for name, dtype, count in _fields(num_tokens, num_reqs, width, index):
        out.append((name, dtype, count, offset))
        offset += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
    return out, offset


class InputBatch:
    def __init__(self, device: torch.device | str, index_dtype: torch.dtype, max_num_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int) -> None:
        """Sized for a step of `max_num_tokens` tokens over `max_num_seqs` requests whose tables hold up to
        `max_blocks_per_seq` blocks; a larger step (a draft model's catch-up) grows the buffers."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.index_dtype = index_dtype
        self._copied = torch.cuda.Event() if self.cuda else None
        self._pending_copy = False
        self._dims: tuple[int, int, int] | None = None  # the step `begin` laid out, until `commit`
        self._allocate(_layout(max_num_tokens, max_num_seqs, max(1, max_blocks_per_seq), index_dtype)[1])

    def _allocate(self, nbytes: int) -> None:
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.host_np = self.host.numpy()
        self.mirror = torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if self.cuda else self.host

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def begin(self, num_tokens: int, num_reqs: int, width: int) -> StepArrays:
        """The host views of a step of `num_tokens` tokens over `num_reqs` requests with tables `width` blocks
        wide (the block tables zeroed: padded with block 0; the rest left to the caller to fill)."""
        if self._pending_copy:
            self._copied.synchronize()  # the last step's copy has read the host buffer
            self._pending_copy = False
        layout, nbytes = _layout(num_tokens, num_reqs, width, self.index_dtype)
        if nbytes > self.capacity:
            self._allocate(max(nbytes, self.capacity + self.capacity // 2))
        self._layout, self._nbytes = layout, nbytes
        views = {}
        for name, dtype, count, offset in layout:
            itemsize = dtype.itemsize
            views[name] = self.host_np[offset:offset + count * itemsize].view(_NUMPY[dtype])
        views["block_tables"] = views["block_tables"].reshape(num_reqs, width)
        views["block_tables"].fill(0)
        self._dims = (num_tokens, num_reqs, width)
        return StepArrays(**views)

    def commit(self) -> StepTensors:
        """Sends the step's fields to the device in one copy (non-blocking on CUDA); their device views."""
        _, num_reqs, width = self._dims
        if self.cuda:
            self.mirror[:self._nbytes].copy_(self.host[:self._nbytes], non_blocking=True)
            self._copied.record()
            self._pending_copy = True
        views = {name: self.mirror[offset:offset + count * dtype.itemsize].view(dtype)
                 for name, dtype, count, offset in self._layout}
        views["block_tables"] = views["block_tables"].view(num_reqs, width)
        self._dims = None
        return StepTensors(**views)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}
