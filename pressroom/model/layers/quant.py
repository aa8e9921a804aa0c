"""4-bit weights kept as shipped (GGUF Q4_0 / Q4_1) and multiplied by torch's int4 CPU kernel.

A Q4 block of 32 inputs is w = q * d + m (Q4_1) or (q - 8) * d (Q4_0); both map exactly onto
torch's layout w = (q - 8) * scale + zero, so nothing is re-quantized. Linear layers always hold
the dequantized weight; when every row of a matrix arrived in 4 bits they also keep the packed
form and use it for steps of at most INT4_MAX_ROWS tokens, where streaming 4x fewer weight bytes
wins over the prepacked bf16 matmul (measured here on the embedded model: 1.35x faster per step
at batch 1, 10% at 8, slower from about 12 rows; see docs/BENCHMARKS.md).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP = 32
INT4_MAX_ROWS = 8


@dataclass(slots=True)
class Q4Weight:
    q: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // GROUP]
    zero: torch.Tensor  # float32 [rows, cols // GROUP]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(GROUP, dim=1)
        zero = self.zero.repeat_interleave(GROUP, dim=1)
        return (self.q.float() - 8) * scale + zero

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Q4Weight":
        """Apply a row permutation (the same for values and their group scales)."""
        return Q4Weight(fn(self.q), fn(self.scale), fn(self.zero))

    def narrow(self, dim: int, start: int, length: int) -> "Q4Weight":
        if dim == 0:
            return Q4Weight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                            self.zero.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError("a 4-bit weight can only be split along its inputs at multiples of 32.")
        g0, gn = start // GROUP, length // GROUP
        return Q4Weight(self.q.narrow(1, start, length), self.scale.narrow(1, g0, gn), self.zero.narrow(1, g0, gn))


def int4_kernel_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


@dataclass(slots=True)
class PackedInt4:
    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [cols // GROUP, rows, 2] in the activation dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return y.view(*x.shape[:-1], y.shape[-1])


def pack_rows(parts: list[tuple[int, Q4Weight]], rows: int, dtype: torch.dtype) -> PackedInt4 | None:
    """Pack a matrix whose rows all came as 4-bit parts (row offset, weight); None if any row did not."""
    covered = sorted((offset, part.shape[0]) for offset, part in parts)
    if sum(n for _, n in covered) != rows or any(a + n != b for (a, n), (b, _) in zip(covered, covered[1:])):
        return None
    ordered = [part for _, part in sorted(parts, key=lambda p: p[0])]
    q = torch.cat([p.q for p in ordered]).to(torch.int32)
    scale = torch.cat([p.scale for p in ordered])
    zero = torch.cat([p.zero for p in ordered])
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return PackedInt4(torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), scales_zeros)
