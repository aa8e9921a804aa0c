"""GGML quant blocks decoded in torch: Q8_0, Q5_0, and the K-quants Q4_K, Q5_K, Q6_K.

Each decoder follows llama.cpp's `dequantize_row_*` arithmetic in float32 (the same products in the same
order), so its values equal the `gguf` package's reference dequantizer bit for bit; they run as a few
vectorised torch ops, many times faster than that reference (its Q8_0 path takes ~13 s for Gemma 3's
262144 x 640 embedding). `unpack_*` split the same blocks, every bit kept, into the arrays the C kernels read
(kernels/csrc/ggml_ops.c; layers/quant.py's GGML forms). Q4_K can also come unpacked as 4-bit values with a
scale and a min per block of 32 (`unpack_q4_k`): exactly the form `Q4Weight` holds for Q4_0 / Q4_1.
"""
from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
QK_K = 256  # values per K-quant super-block


def dequantize(raw: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> torch.Tensor | None:
    """Rows of quant blocks ([rows, bytes]) as float32 [rows, cols]; None for a type decoded elsewhere."""
    decode = _DECODERS.get(ggml_type)
    if decode is None:
        return None
    rows = raw.shape[0]
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    return decode(_blocks(raw, type_size)).reshape(rows, -1)


def unpack_q4_k(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows ([rows, bytes]) as (q uint8 [rows, cols] in 0..15, scale, min float32 [rows, cols // 32]),
    w = q * scale + min exactly: scale = d * sc and min = -(dmin * m) per block of 32."""
    rows = raw.shape[0]
    q, scale, low = _q4_k_parts(_blocks(raw, 144))
    return q.reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)


# --- the C kernels' layouts (kernels/csrc/ggml_ops.c): every bit of the blocks, fp16 scales widened to fp32 ---


def unpack_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(qs int8 [rows, cols], d [rows, cols // 32])."""
    b = _blocks(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1), _f16(b, 0).reshape(raw.shape[0], -1)


def unpack_q5_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qs [rows, cols // 2], qh int32 [rows, cols // 32] (bit j: value j's fifth bit), d [rows, cols // 32])."""
    b, rows = _blocks(raw, 22), raw.shape[0]
    qh = b[:, 2:6].contiguous().view(torch.int32).reshape(rows, -1)
    return b[:, 6:22].reshape(rows, -1).contiguous(), qh, _f16(b, 0).reshape(rows, -1)


def unpack_k4(raw: np.ndarray, five: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor]:
    """Q4_K (five False) or Q5_K rows as (qs [rows, cols // 2], qh [rows, cols // 8] or None, sc, mn uint8
    [rows, cols // 32], d, dmin [rows, cols // 256])."""
    rows = raw.shape[0]
    b = _blocks(raw, 176 if five else 144)
    sc, mn = _k_scales_u8(b[:, 4:16])
    qh = b[:, 16:48].reshape(rows, -1).contiguous() if five else None
    qs = b[:, 48:176] if five else b[:, 16:144]
    return (qs.reshape(rows, -1).contiguous(), qh, sc.reshape(rows, -1).contiguous(), mn.reshape(rows, -1).contiguous(),
            _f16(b, 0).reshape(rows, -1), _f16(b, 2).reshape(rows, -1))


def unpack_q6_k(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ql [rows, cols // 2], qh [rows, cols // 4], sc int8 [rows, cols // 16], d [rows, cols // 256])."""
    rows, b = raw.shape[0], _blocks(raw, 210)
    sc = b[:, 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    return (b[:, :128].reshape(rows, -1).contiguous(), b[:, 128:192].reshape(rows, -1).contiguous(), sc,
            _f16(b, 208).reshape(rows, -1))


def _blocks(raw: np.ndarray, type_size: int) -> torch.Tensor:
    # A read-only view of the mapped file is copied (its bytes only): torch wants memory it may write.
    raw = np.ascontiguousarray(raw) if raw.flags.writeable else raw.copy()
    return torch.from_numpy(raw).view(-1, type_size)


# --- decoders: [blocks, type_size] uint8 -> [blocks, values] float32 ----------------------------------


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high ones (GGML's order within a run of bytes)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    qh = blocks[:, 2:6].contiguous().view(torch.int32)  # bit j is value j's fifth bit
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    low = _nibbles(blocks[:, 6:22]).flatten(1).int()
    return ((low | (high << 4)) - 16).float() * d


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = _k_scales_u8(scales)
    return sc.float(), m.float()


def _k_scales_u8(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in a Q4_K / Q5_K block's 12 bytes (get_scale_min_k4)."""
    lo, mid, top = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    m = torch.cat((mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return sc, m


def _q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([blocks, 8, 32] 4-bit values, [blocks, 8] scales, [blocks, 8] mins) with w = q * scale + min."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return q, d * sc, -(dmin * m)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q, scale, low = _q4_k_parts(blocks)
    return (q.float() * scale[..., None] + low[..., None]).flatten(1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit i of byte l: the fifth bit of value l of sub-block i
    high = (qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    q = (low | (high << 4)).float()
    return (q * (d * sc)[..., None] - (dmin * m)[..., None]).flatten(1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    # Two halves of 128 values; in each, ql's 64 bytes give values 0-63 (low nibbles) and 64-127 (high), and
    # each qh byte four 2-bit fifth-and-sixth bits, one per run of 32.
    low = _nibbles(ql.reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = ((qh.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).int() - 32).float().reshape(-1, 16, 16)
    return ((d * scales)[..., None] * q).flatten(1)


_DECODERS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
