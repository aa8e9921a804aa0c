"""Int4 weights with a zero point and a scale per group of inputs (GPTQ, AWQ): packing and the torch reference.

The one form a layer holds (model/quantization/int4.py), GPTQ's:
- `qweight` int32 [K / 8, N]: input 8r + j of output n in bits 4j..4j+3 of word [r, n];
- `scales` fp16 [G, N] and `zeros` uint8 [G, N] (the zero point itself, 0..16: GPTQ v1 stores zero - 1);
- `g_idx` int32 [K], the group of each input (act-order), or None: input k is in group k // group_size.
The weight [N, K] is (q - zero) * scale. In fp32 that product is exact (|q - zero| <= 16, an fp16 scale), so the
reference, the Triton kernel and a twin built from `dequantize` multiply by the very same values.

AWQ packs along the outputs instead (`qweight` [K, N / 8], `qzeros` [G, N / 8]) in the interleaved order AWQ_ORDER:
nibble i of a word holds output 8c + AWQ_ORDER[i]. GPTQ's `qzeros` [G, N / 8] are packed along the outputs in
plain order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PLAIN_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits (the top nibble may set the sign)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_inputs(values: torch.Tensor) -> torch.Tensor:
    """values [K, N] in 0..15 -> int32 [K / 8, N], input 8r + j in bits 4j of row r (GPTQ's qweight)."""
    k, n = values.shape
    nibbles = values.to(torch.int64).view(k // 8, 8, n) << _SHIFTS.to(values.device, torch.int64).view(1, 8, 1)
    return _to_int32(nibbles.sum(1))


def unpack_inputs(packed: torch.Tensor) -> torch.Tensor:
    """pack_inputs' inverse: int32 [K / 8, N] -> int32 [K, N] in 0..15."""
    rows, n = packed.shape
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device).view(1, 8, 1)) & 0xF).reshape(rows * 8, n)


def pack_outputs(values: torch.Tensor, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """values [R, N] in 0..15 -> int32 [R, N / 8]: nibble i of word c holds column 8c + order[i]."""
    r, n = values.shape
    cols = values.to(torch.int64).view(r, n // 8, 8)[:, :, list(order)]
    return _to_int32((cols << _SHIFTS.to(values.device, torch.int64)).sum(-1))


def unpack_outputs(packed: torch.Tensor, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """pack_outputs' inverse: int32 [R, N / 8] -> int32 [R, N] in 0..15."""
    r, words = packed.shape
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, N / 8, nibble i]
    where = torch.tensor([order.index(j) for j in range(8)], device=packed.device)  # column j's nibble
    return nibbles[:, :, where].reshape(r, words * 8)


@dataclass(slots=True)
class Int4Weight:
    """Output channels of a GPTQ/AWQ weight in the layer's form (module docstring); `shape` is the dense [N, K]."""
    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # fp16 [G, N]
    zeros: torch.Tensor  # uint8 [G, N]
    g_idx: torch.Tensor | None  # int32 [K] (act-order), or None for k // group_size
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[1], self.qweight.shape[0] * 8))

    def columns(self, start: int, stop: int) -> Int4Weight:
        """Output channels [start, stop)."""
        return Int4Weight(self.qweight[:, start:stop].contiguous(), self.scales[:, start:stop].contiguous(),
                          self.zeros[:, start:stop].contiguous(), self.g_idx, self.group_size)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.g_idx, self.group_size)


def groups_of_inputs(k: int, g_idx: torch.Tensor | None, group_size: int, device=None) -> torch.Tensor:
    """The group of each of the k inputs."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // group_size


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
               group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in `dtype` (computed in fp32, where it is exact)."""
    q = unpack_inputs(qweight)
    groups = groups_of_inputs(q.shape[0], g_idx, group_size, q.device)
    w = (q - zeros[groups].to(torch.int32)).to(torch.float32) * scales[groups].to(torch.float32)
    return w.t().to(dtype)


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times the weight, dequantized to x's dtype at each call (nothing cached: memory stays 4-bit)."""
    return torch.nn.functional.linear(x, dequantize(qweight, scales, zeros, g_idx, group_size, x.dtype), bias)
