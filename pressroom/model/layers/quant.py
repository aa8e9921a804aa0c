"""4-bit weights kept as shipped (GGUF Q4_0 / Q4_1), multiplied without dequantizing them.

A Q4 block of 32 inputs is w = q * d + m (Q4_1; Q4_0 is m = -8 d): nothing is re-quantized. Linear
layers always hold the dequantized weight; when every row of a matrix arrived in 4 bits they also
keep the 4-bit form and use it for steps of at most INT4_MAX_ROWS tokens, where streaming 4x fewer
weight bytes wins over the dense matmul (measured on the embedded model: 1.35x faster per step at
batch 1, 10% at 8, slower from about 12 rows; see docs/BENCHMARKS.md).

Two kernels take the 4-bit form: pressroom's C kernel (kernels/csrc/quant_ops.c: llama.cpp's
arithmetic, activations rounded to int8 per block of 32, AVX2 and VNNI code), and, where no C
compiler is found, torch's int4 kernel (bf16 activations).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pressroom.kernels import cpu

GROUP = 32
INT4_MAX_ROWS = 8


@dataclass(slots=True)
class Q4Weight:
    q: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // GROUP]: d
    min: torch.Tensor  # float32 [rows, cols // GROUP]: m

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(GROUP, dim=1)
        low = self.min.repeat_interleave(GROUP, dim=1)
        return self.q.float() * scale + low

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Q4Weight:
        """Apply a row permutation (the same for values and their group scales)."""
        return Q4Weight(fn(self.q), fn(self.scale), fn(self.min))

    def narrow(self, dim: int, start: int, length: int) -> Q4Weight:
        if dim == 0:
            return Q4Weight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                            self.min.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError("a 4-bit weight can only be split along its inputs at multiples of 32.")
        g0, gn = start // GROUP, length // GROUP
        return Q4Weight(self.q.narrow(1, start, length), self.scale.narrow(1, g0, gn), self.min.narrow(1, g0, gn))


@dataclass(slots=True)
class Q8Weight:
    """GGUF Q8_0: w = q * d per block of 32 inputs (kept for the LM head, which a tied embedding shares)."""
    q: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // GROUP]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(GROUP, dim=1)

    def narrow(self, dim: int, start: int, length: int) -> Q8Weight:
        if dim == 0:
            return Q8Weight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError("an 8-bit weight can only be split along its inputs at multiples of 32.")
        return Q8Weight(self.q.narrow(1, start, length), self.scale.narrow(1, start // GROUP, length // GROUP))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _c_matmul(x, lambda flat: cpu.q8_matmul(flat, self.q, self.scale))


def _c_matmul(x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The C kernels take and give fp32 rows; an fp32 model's 2-D activations pass through untouched
    (each conversion skipped is a microsecond, and a decode step makes 120 of these calls)."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    y = kernel(flat)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def int4_kernel_available() -> bool:
    return cpu.available() or _torch_int4_available()


def _torch_int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


@dataclass(slots=True)
class NibbleMatrix:
    """The 4-bit form the C kernel reads: blocks of 32 inputs in pairs, byte j of a pair holding
    input j of the even block (low nibble) and of the odd block (high), so one 32-byte load and two
    masks unpack 64 weights. An odd last block pairs with zeros."""
    qs: torch.Tensor  # uint8 [rows, pairs * 32]
    scale: torch.Tensor  # float32 [rows, cols // GROUP]
    min: torch.Tensor  # float32 [rows, cols // GROUP]

    @classmethod
    def pack(cls, w: Q4Weight) -> NibbleMatrix:
        rows, cols = w.shape
        blocks = w.q.view(rows, cols // GROUP, GROUP)
        if blocks.shape[1] % 2:
            blocks = torch.cat([blocks, torch.zeros(rows, 1, GROUP, dtype=blocks.dtype)], dim=1)
        pairs = blocks.view(rows, -1, 2, GROUP)
        qs = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        return cls(qs.reshape(rows, -1).contiguous(), w.scale.float().contiguous(), w.min.float().contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _c_matmul(x, lambda flat: cpu.q4_matmul(flat, self.qs, self.scale, self.min))


@dataclass(slots=True)
class PackedInt4:
    """torch's int4 layout, w = (q - 8) * scale + zero, for its kernel."""
    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [cols // GROUP, rows, 2], bf16

    @classmethod
    def pack(cls, w: Q4Weight) -> PackedInt4:
        zero = w.min + 8 * w.scale
        scales_zeros = torch.stack([w.scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 1), scales_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """torch's kernel is vectorised for bf16 activations only (fp32 ones take a scalar path 20x
        slower, measured here), so an fp32 model's activations cross it in bf16; it sums in fp32."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


def pack_rows(parts: list[tuple[int, Q4Weight]], rows: int) -> NibbleMatrix | PackedInt4 | None:
    """Pack a matrix whose rows all came as 4-bit parts (row offset, weight); None if any row did not."""
    covered = sorted((offset, part.shape[0]) for offset, part in parts)
    if sum(n for _, n in covered) != rows or any(a + n != b for (a, n), (b, _) in zip(covered, covered[1:])):
        return None
    ordered = [part for _, part in sorted(parts, key=lambda p: p[0])]
    whole = Q4Weight(*(torch.cat([getattr(p, f) for p in ordered]) for f in ("q", "scale", "min")))
    if cpu.available():
        return NibbleMatrix.pack(whole)
    return PackedInt4.pack(whole) if _torch_int4_available() else None
