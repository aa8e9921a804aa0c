"""Checkpoint tensors read on demand, so a tensor-parallel rank reads only its slices of the weights.

The loaders (safetensors, GGUF) hand each checkpoint tensor over as a `LazyWeight`: its shape and dtype are
known, nothing is read yet. A parameter's weight loader narrows it to this rank's rows or columns first and
materializes last (`materialize`), so only the part it keeps is read from the file (and, for GGUF, only
those quantized blocks are dequantized). A tensor a rank needs whole (a norm, a replicated KV head, any
tensor at tensor_parallel_size 1) is simply loaded whole.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Per dimension of the stored tensor: the [start, stop) range a LazyWeight stands for.
Index = tuple[tuple[int, int], ...]


class ReadTally:
    """Bytes read from a checkpoint, by tensor name, over one load (as stored: a GGUF's quantized blocks)."""

    __slots__ = ("by_name",)

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}

    def add(self, name: str, n_bytes: int) -> None:
        self.by_name[name] = self.by_name.get(name, 0) + n_bytes

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


class LazyWeight:
    """A checkpoint tensor (or a part of one) not read yet. `read(index)` reads the stored tensor's
    `index` ranges and returns them as the checkpoint ships them: a tensor, or a GGUF `Q4Weight` /
    `Q8Weight` kept in its quantized form."""

    __slots__ = ("dtype", "_read", "_index")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[Index], Any]) -> None:
        self.dtype, self._read = dtype, read
        self._index: Index = tuple((0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._index)

    def dim(self) -> int:
        return len(self._index)

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        """Rows or columns [start, start + length) of dimension `dim`, still unread (as Tensor.narrow)."""
        dim = dim + self.dim() if dim < 0 else dim
        first, stop = self._index[dim] if 0 <= dim < self.dim() else (0, -1)
        if start < 0 or length < 0 or first + start + length > stop:
            raise ValueError(f"cannot narrow a checkpoint tensor of shape {tuple(self.shape)} to "
                             f"[{start}, {start + length}) of dimension {dim}.")
        part = LazyWeight((), self.dtype, self._read)
        part._index = (*self._index[:dim], (first + start, first + start + length), *self._index[dim + 1:])
        return part

    def load(self) -> Any:
        """Read this part of the checkpoint: a tensor of `shape`, or a quantized weight of that shape."""
        return self._read(self._index)

    def __repr__(self) -> str:
        return f"LazyWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


def materialize(weight: Any) -> Any:
    """`weight` read (a LazyWeight), or as it is (a tensor or a quantized weight already in memory)."""
    return weight.load() if isinstance(weight, LazyWeight) else weight
