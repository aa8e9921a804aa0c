"""GGUF weights kept as shipped, multiplied without dequantizing them.

Q4_0 / Q4_1 (`Q4Weight`, below) and the GGML forms of `GgmlRows` (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K: every bit of
the checkpoint's blocks in the C kernels' layouts, kernels/csrc/ggml_ops.c).

The GGML forms replace the layer's dense weight and serve every step, whatever its size: their kernels round
the activations per block and take integer dot products exactly as llama.cpp's CPU backend does (Q8_0
activations for Q8_0 / Q5_0, Q8_K for the K-quants), so a GGUF model computes llama.cpp's numbers, and at
decode they stream 3.5-5x fewer bytes than fp32. Without a C compiler the torch reference
(kernels/ggml.py) computes the same products.

A Q4 block of 32 inputs is w = q * d + m (Q4_1; Q4_0 is m = -8 d): nothing is re-quantized. Linear
layers always hold the dequantized weight; when every row of a matrix arrived in 4 bits they also
keep the 4-bit form and use it for steps of at most INT4_MAX_ROWS tokens, where streaming 4x fewer
weight bytes wins over the dense matmul (measured on the embedded model: 1.35x faster per step at
batch 1, 10% at 8, slower from about 12 rows; see docs/BENCHMARKS.md). With the C kernels a 4-bit matrix
also keeps a `VnniPanel` (vnni_gemm.c; 1.25 bytes a weight more), which serves steps of 9 to VNNI_MAX_ROWS tokens
with the row kernel's bits (AVX-512 VNNI: 1.2-1.5x oneDNN's bf16 GEMM at 16-128 rows; AVX2: 2-5x its fp32 one),
and on AVX-512 VNNI the Q8_0 LM head a `Q8Panel` for steps of two tokens or more, with llama.cpp's bits as the
row kernel gives them (2-2.5x faster at 8-32 rows).

Two kernels take the 4-bit form: pressroom's C kernel (kernels/csrc/quant_ops.c: llama.cpp's
arithmetic, activations rounded to int8 per block of 32, AVX2 and VNNI code), and, where no C
compiler is found, torch's int4 kernel (bf16 activations).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from pressroom.kernels import cpu, ggml

GROUP = 32
INT4_MAX_ROWS = 8
# The panel GEMM beat oneDNN's bf16 one up to 128 rows on the embedded model's shapes and lost at 512 (0.65x);
# prefill chunks beyond this take the dense weight.
VNNI_MAX_ROWS = 128


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
class VnniPanel:
    """A 4-bit matrix as vnni_gemm.c reads it: the codes q as bytes, 16 rows x 4 inputs per 64-byte vector
    ([ceil(rows / 16), cols / 32, 8, 16, 4]), and per 16 rows and block of 32 inputs d and m: w = d q + m."""
    panel: torch.Tensor  # uint8
    d: torch.Tensor  # float32 [ceil(rows / 16), cols / 32, 16]
    m: torch.Tensor  # float32, as d
    rows: int

    @classmethod
    def pack(cls, w: Q4Weight) -> VnniPanel:
        rows, cols = w.shape
        vectors, blocks, pad = -(-rows // 16), cols // GROUP, -rows % 16
        # 4 codes of a row move together: as one int32 the copy moves a quarter as many elements (4x faster)
        codes = torch.nn.functional.pad(w.q, (0, 0, 0, pad)).contiguous().view(torch.int32).view(vectors, 16, blocks, 8)
        panel = codes.permute(0, 2, 3, 1).contiguous().view(torch.uint8)

        def per_vector(t: torch.Tensor) -> torch.Tensor:
            t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))
            return t.view(vectors, 16, blocks).transpose(1, 2).contiguous()

        return cls(panel.view(vectors, blocks, 8, 16, 4), per_vector(w.scale), per_vector(w.min), rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _c_matmul(x, lambda flat: cpu.vnni_gemm(flat, self.panel, self.d, self.m, self.rows))


@dataclass(slots=True)
class Q8Panel:
    """A Q8_0 matrix as vnni_gemm.c's vnni_q8_gemm_f32 reads it: VnniPanel's layout over the codes q + 128, and
    d per 16 rows and block (GGUF's fp16 scales, as fp32)."""
    panel: torch.Tensor  # uint8 [ceil(rows / 16), cols / 32, 8, 16, 4]
    d: torch.Tensor  # float32 [ceil(rows / 16), cols / 32, 16]
    rows: int

    @classmethod
    def pack(cls, w: Q8Weight) -> Q8Panel:
        codes = w.q.contiguous().view(torch.uint8) ^ 0x80  # q + 128, as a byte
        vectors = VnniPanel.pack(Q4Weight(codes, w.scale, w.scale))
        return cls(vectors.panel, vectors.d, w.q.shape[0])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _c_matmul(x, lambda flat: cpu.vnni_q8_gemm(flat, self.panel, self.d, self.rows))


def q4_panels() -> bool:
    """Whether 4-bit matrices also keep a VnniPanel here (the C kernels built for AVX-512 VNNI or AVX2)."""
    return cpu.panel_products()[0]


def q8_panels() -> bool:
    """Whether the Q8_0 LM head also keeps a Q8Panel here (AVX-512 VNNI: AVX2's maddubs would saturate)."""
    return cpu.panel_products()[1]


@dataclass(slots=True)
class NibbleMatrix:
    """The 4-bit form the C kernel reads (quant_ops.c): rows in tiles of 8, and per tile and block of 32 inputs
    four quarters of 32 bytes, byte 4 r + e of quarter k holding input 4 k + e of row r (low nibble) and input
    16 + 4 k + e (high). One unpacked quarter then holds four inputs of each of 8 rows, lane by lane, so one
    integer dot product with four broadcast activations advances 8 rows. The last tile is padded with zeros."""
    qs: torch.Tensor  # uint8 [tiles, blocks * 128]
    scale: torch.Tensor  # float32 [tiles, blocks, 8]: d
    min: torch.Tensor  # float32 [tiles, blocks, 8]: m
    rows: int
    panel: VnniPanel | None = None  # for steps of INT4_MAX_ROWS to VNNI_MAX_ROWS tokens

    @property
    def max_rows(self) -> int:
        """The most tokens a step may have for this form to serve it (beyond: the dense weight)."""
        return VNNI_MAX_ROWS if self.panel is not None else INT4_MAX_ROWS

    @classmethod
    def pack(cls, w: Q4Weight) -> NibbleMatrix:
        rows, cols = w.shape
        blocks, pad = cols // GROUP, -rows % 8
        q, scale, low = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (w.q, w.scale.float(), w.min.float()))
        tiles = q.shape[0] // 8
        q = q.view(tiles, 8, blocks, 2, 4, 4)  # tile, row, block, half, quarter, byte: input 16 half + 4 quarter + byte
        nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # tile, row, block, quarter, byte
        qs = nibbles.permute(0, 2, 3, 1, 4).reshape(tiles, -1).contiguous()
        return cls(qs, *(t.view(tiles, 8, blocks).transpose(1, 2).contiguous() for t in (scale, low)), rows,
                   VnniPanel.pack(w) if q4_panels() else None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel is not None and x.numel() > INT4_MAX_ROWS * x.shape[-1]:
            return self.panel.matmul(x)
        return _c_matmul(x, lambda flat: cpu.q4_matmul(flat, self.qs, self.scale, self.min, self.rows))


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


# --- GGML forms --------------------------------------------------------------------------------------------


class GgmlRows:
    """A weight matrix as arrays of rows ([rows, ...] each; PER: how many columns one element of each covers),
    narrowed along the inputs only at BLOCK boundaries. Subclasses are slotted dataclasses of those arrays."""
    __slots__ = ()
    BLOCK: ClassVar[int]
    PER: ClassVar[tuple[int, ...]]  # per field, in order
    KIND: ClassVar[str]  # its name in cpu.GGML_KINDS
    C_FIELDS: ClassVar[tuple[str, ...]]  # per field, its name in cpu.GGML_PART_FIELDS

    def c_part(self) -> list[int]:
        """This matrix as one part of csrc/ggml_matrix.h's description: kind, rows, then array pointers."""
        arrays = dict(zip(self.C_FIELDS, self._arrays()))
        if not all(a is None or a.is_contiguous() for a in arrays.values()):
            raise ValueError("the C kernels read a GGML matrix's arrays as contiguous rows.")
        pointers = [0 if arrays.get(f) is None else arrays[f].data_ptr() for f in cpu.GGML_PART_FIELDS[2:]]
        return [cpu.GGML_KINDS.index(self.KIND), self.shape[0], *pointers]

    def c_matrix(self) -> torch.Tensor:
        return c_matrix([self])

    def _arrays(self) -> list[torch.Tensor | None]:
        return [getattr(self, name) for name in self.__slots__]  # the dataclass's fields, in order

    @property
    def shape(self) -> torch.Size:
        first = self._arrays()[0]
        return torch.Size((first.shape[0], first.shape[1] * self.PER[0]))

    def narrow(self, dim: int, start: int, length: int) -> GgmlRows:
        if dim == 0:
            return type(self)(*(None if a is None else a.narrow(0, start, length) for a in self._arrays()))
        if start % self.BLOCK or length % self.BLOCK:
            raise ValueError(f"a {type(self).__name__} can only be split along its inputs at multiples of "
                             f"{self.BLOCK}.")
        return type(self)(*(None if a is None else a.narrow(1, start // per, length // per)
                            for a, per in zip(self._arrays(), self.PER)))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GgmlRows:
        """Apply a row permutation to every array."""
        return type(self)(*(None if a is None else fn(a) for a in self._arrays()))

    @classmethod
    def cat(cls, parts: list[GgmlRows]) -> GgmlRows:
        columns = zip(*(p._arrays() for p in parts))
        return cls(*(None if c[0] is None else torch.cat(c).contiguous() for c in columns))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T as llama.cpp computes it (C kernel, or the torch reference without a compiler)."""
        arrays = self._arrays()
        if cpu.available():
            return _c_matmul(x, lambda flat: self._kernel(flat, arrays))
        return _c_matmul(x, lambda flat: self._reference(flat, arrays))

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _kernel(x: torch.Tensor, arrays: list) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _reference(x: torch.Tensor, arrays: list) -> torch.Tensor:
        raise NotImplementedError


def _per_block(scale: torch.Tensor, width: int) -> torch.Tensor:
    return scale.repeat_interleave(width, dim=1)


@dataclass(slots=True)
class Q8Weight(GgmlRows):
    """GGUF Q8_0: w = q * d per block of 32 inputs."""
    q: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // 32]
    BLOCK: ClassVar[int] = 32
    PER: ClassVar[tuple[int, ...]] = (1, 32)
    KIND: ClassVar[str] = "Q8_0"
    C_FIELDS: ClassVar[tuple[str, ...]] = ("qs", "d")

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * _per_block(self.scale, 32)

    _kernel = staticmethod(lambda x, a: cpu.ggml_q8_0_matmul(x, *a))
    _reference = staticmethod(lambda x, a: ggml.q8_0_matmul(x, *a))


@dataclass(slots=True)
class Q8Blocks:
    """Q8_0 in GGUF's own blocks (fp16 scale, then 32 codes: one array a row), the form of a large matrix the C
    kernel streams from memory, the LM head: it reads it ~8% faster than Q8Weight's two arrays, with the same
    sums in the same order (the same bits)."""
    blocks: torch.Tensor  # uint8 [rows, cols // 32 * 34]
    panel: Q8Panel | None = None  # for steps of two tokens or more: the same bits, 2-2.5x faster at 8-32

    @classmethod
    def pack(cls, w: Q8Weight) -> Q8Blocks:
        half = w.scale.to(torch.float16)
        if not torch.equal(half.float(), w.scale):
            raise ValueError("Q8_0 blocks hold fp16 scales; these scales are not all fp16 values.")
        rows, cols = w.q.shape
        codes = w.q.contiguous().view(torch.uint8).view(rows, cols // 32, 32)
        scales = half.contiguous().view(torch.uint8).view(rows, cols // 32, 2)
        return cls(torch.cat([scales, codes], dim=2).view(rows, -1).contiguous(),
                   Q8Panel.pack(w) if q8_panels() else None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // 34 * 32))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel is not None and x.numel() > x.shape[-1]:  # one token streams the blocks at memory speed
            return self.panel.matmul(x)
        return _c_matmul(x, lambda flat: cpu.ggml_q8_0_blocks_matmul(flat, self.blocks))


@dataclass(slots=True)
class Q5Weight(GgmlRows):
    """GGUF Q5_0: w = (u - 16) * d per block of 32, u's low nibbles in qs, fifth bits in qh."""
    qs: torch.Tensor  # uint8 [rows, cols // 2]
    qh: torch.Tensor  # int32 [rows, cols // 32]
    scale: torch.Tensor  # float32 [rows, cols // 32]
    BLOCK: ClassVar[int] = 32
    PER: ClassVar[tuple[int, ...]] = (2, 32, 32)
    KIND: ClassVar[str] = "Q5_0"
    C_FIELDS: ClassVar[tuple[str, ...]] = ("qs", "qh", "d")

    def dequantize(self) -> torch.Tensor:
        return (ggml.q5_0_values(self.qs, self.qh).float() - 16) * _per_block(self.scale, 32)

    _kernel = staticmethod(lambda x, a: cpu.ggml_q5_0_matmul(x, *a))
    _reference = staticmethod(lambda x, a: ggml.q5_0_matmul(x, *a))


@dataclass(slots=True)
class KWeight(GgmlRows):
    """GGUF Q4_K (qh None) or Q5_K: per sub-block j of 32, w = (d sc_j) u - (dmin mn_j)."""
    qs: torch.Tensor  # uint8 [rows, cols // 2]
    qh: torch.Tensor | None  # uint8 [rows, cols // 8]: Q5_K's fifth bits
    sc: torch.Tensor  # uint8 [rows, cols // 32]
    mn: torch.Tensor  # uint8 [rows, cols // 32]
    d: torch.Tensor  # float32 [rows, cols // 256]
    dmin: torch.Tensor  # float32 [rows, cols // 256]
    BLOCK: ClassVar[int] = 256
    PER: ClassVar[tuple[int, ...]] = (2, 8, 32, 32, 256, 256)
    KIND: ClassVar[str] = "K4"
    C_FIELDS: ClassVar[tuple[str, ...]] = ("qs", "qh", "sc", "mn", "d", "dmin")

    def dequantize(self) -> torch.Tensor:
        u = ggml.k4_values(self.qs, self.qh).float()
        scale = _per_block(self.d, 8) * self.sc.float()
        low = -(_per_block(self.dmin, 8) * self.mn.float())
        return u * _per_block(scale, 32) + _per_block(low, 32)

    _kernel = staticmethod(lambda x, a: cpu.ggml_k4_matmul(x, *a))
    _reference = staticmethod(lambda x, a: ggml.k4_matmul(x, *a))


@dataclass(slots=True)
class Q6KWeight(GgmlRows):
    """GGUF Q6_K: per sub-block j of 16, w = (d sc_j) (u - 32)."""
    ql: torch.Tensor  # uint8 [rows, cols // 2]
    qh: torch.Tensor  # uint8 [rows, cols // 4]
    sc: torch.Tensor  # int8 [rows, cols // 16]
    d: torch.Tensor  # float32 [rows, cols // 256]
    BLOCK: ClassVar[int] = 256
    PER: ClassVar[tuple[int, ...]] = (2, 4, 16, 256)
    KIND: ClassVar[str] = "Q6_K"
    C_FIELDS: ClassVar[tuple[str, ...]] = ("qs", "qh", "sc", "d")

    def dequantize(self) -> torch.Tensor:
        scale = _per_block(self.d, 16) * self.sc.float()
        return _per_block(scale, 16) * (ggml.q6_k_values(self.ql, self.qh).float() - 32)

    _kernel = staticmethod(lambda x, a: cpu.ggml_q6_k_matmul(x, *a))
    _reference = staticmethod(lambda x, a: ggml.q6_k_matmul(x, *a))


def c_matrix(parts: list[GgmlRows]) -> torch.Tensor:
    """csrc/ggml_matrix.h's description of rows stacked from these parts: int64, pointers into their arrays
    (valid while the parts live)."""
    if len(parts) > cpu.GGML_MAX_PARTS:
        raise ValueError(f"a matrix of {len(parts)} runs of GGML types; the C kernels take {cpu.GGML_MAX_PARTS}.")
    fields = [len(parts)] + [v for p in parts for v in p.c_part()]
    fields += [0] * (1 + cpu.GGML_MAX_PARTS * len(cpu.GGML_PART_FIELDS) - len(fields))
    return torch.tensor(fields, dtype=torch.int64)


@dataclass(slots=True)
class GgmlStack:
    """A stacked matrix (qkv, gate_up) whose parts came in different GGML types: one product per run of rows
    of one type (in one C call that rounds the activations once per block size), concatenated."""
    parts: list[GgmlRows]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if cpu.available() and len(self.parts) <= cpu.GGML_MAX_PARTS:
            matrix, rows = self.c_matrix(), sum(p.shape[0] for p in self.parts)
            return _c_matmul(x, lambda flat: cpu.ggml_matrix_matmul(flat, matrix, rows))
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    def c_matrix(self) -> torch.Tensor:
        return c_matrix(self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def pack_ggml(parts: list[tuple[int, GgmlRows]], rows: int) -> GgmlRows | GgmlStack | None:
    """The matrix from its parts (row offset, weight), runs of one type joined; None unless they cover every row
    exactly once."""
    ordered = sorted(parts, key=lambda p: p[0])
    starts = [0] + [offset + part.shape[0] for offset, part in ordered]
    if [offset for offset, _ in ordered] != starts[:-1] or starts[-1] != rows:
        return None
    runs: list[list[GgmlRows]] = []
    for _, part in ordered:
        if runs and type(runs[-1][0]) is type(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [type(run[0]).cat(run) for run in runs]
    return joined[0] if len(joined) == 1 else GgmlStack(joined)
