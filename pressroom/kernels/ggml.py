"""The torch reference of kernels/csrc/ggml_ops.c: GGML-quantized weights times activations rounded per block
as llama.cpp's CPU backend rounds them (Q8_0 activations for Q8_0 / Q5_0 weights, Q8_K for the K-quants).

The integer dot products are exact (float64 sums of small integers), so this computes the C kernels' numbers
up to the order of the fp32 block sums. It serves the tests and machines without a C compiler. The weight
arrays are the C kernels' layouts (see ggml_ops.c's header); `*_values` unpack their integers.
"""
from __future__ import annotations

import torch

QK, QK_K = 32, 256
_ROW_CHUNK = 2048  # rows per step of the reference, so [tokens, rows, blocks] stays small


def _div(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t in fp32, one rounding (torch's `scalar / tensor` multiplies by a rounded reciprocal)."""
    return torch.full_like(t, numerator).div(t)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tokens, cols] -> (q int8, d fp32 per 32 with fp16's precision, sums of q per 32)."""
    b = x.float().reshape(x.shape[0], -1, QK)
    amax = b.abs().amax(-1)
    inv = torch.where(amax != 0, _div(127.0, amax), torch.zeros_like(amax))
    q = torch.round(b * inv[..., None])
    d = (amax / 127).half().float()
    return q.to(torch.int8).reshape(x.shape), d, q.sum(-1).int()


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tokens, cols] -> (q int8, d fp32 per 256, sums of q per 16): iscale = -127 / the value of largest
    magnitude (its first), q = round(iscale x), d = 1 / iscale."""
    b = x.float().reshape(x.shape[0], -1, QK_K)
    peak = b.gather(-1, b.abs().argmax(-1, keepdim=True)).squeeze(-1)
    zero = peak == 0
    iscale = torch.where(zero, torch.zeros_like(peak), _div(-127.0, peak))
    q = torch.round(b * iscale[..., None]).clamp(max=127)
    d = torch.where(zero, torch.zeros_like(peak), _div(1.0, iscale))
    return q.to(torch.int8).reshape(x.shape), d, q.reshape(x.shape[0], -1, 16).sum(-1).int()


# --- the layouts' integers -----------------------------------------------------------------------------------


def _nibble_runs(qs: torch.Tensor, run: int) -> torch.Tensor:
    """[rows, n] bytes in runs of `run`: each run's low nibbles, then its high ones."""
    r = qs.reshape(qs.shape[0], -1, run)
    return torch.stack((r & 0x0F, r >> 4), dim=-2).reshape(qs.shape[0], -1)


def q5_0_values(qs: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """u in 0..31 ([rows, cols] uint8): w = (u - 16) d."""
    low = _nibble_runs(qs, 16).reshape(qs.shape[0], -1, QK)
    high = (qh[..., None] >> torch.arange(QK, dtype=torch.int32)) & 1
    return (low | (high << 4).to(torch.uint8)).reshape(qs.shape[0], -1)


def k4_values(qs: torch.Tensor, qh: torch.Tensor | None) -> torch.Tensor:
    """Q4_K (qh None: u in 0..15) or Q5_K (u in 0..31) values, [rows, cols] uint8."""
    low = _nibble_runs(qs, 32)
    if qh is None:
        return low
    bits = (qh.reshape(qs.shape[0], -1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return low | (bits.reshape(qs.shape[0], -1) << 4)


def q6_k_values(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """u in 0..63 ([rows, cols] uint8): w = d sc (u - 32). Per half of 256: ql's 64 bytes give values 0-63 (low
    nibbles) and 64-127 (high); each qh byte four 2-bit high parts, one per run of 32."""
    rows = ql.shape[0]
    low = _nibble_runs(ql, 64).reshape(rows, -1, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    high = (qh.reshape(rows, -1, 1, 32) >> shifts) & 3
    return (low | (high << 4)).reshape(rows, -1)


# --- products ------------------------------------------------------------------------------------------------


def _block_dots(xq: torch.Tensor, u: torch.Tensor, block: int) -> torch.Tensor:
    """[tokens, rows, blocks] exact integer dot products (float64) of each block of `block` values."""
    x = xq.double().reshape(xq.shape[0], -1, block)
    w = u.double().reshape(u.shape[0], -1, block)
    return torch.einsum("tbk,rbk->trb", x, w)


def _by_rows(fn, rows: int) -> torch.Tensor:
    return torch.cat([fn(r, min(r + _ROW_CHUNK, rows)) for r in range(0, rows, _ROW_CHUNK)], dim=1)


def q8_0_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xq, xd, _ = quantize_q8_0(x)

    def part(r0: int, r1: int) -> torch.Tensor:
        dots = _block_dots(xq, qs[r0:r1], QK).float()
        return (dots * (d[None, r0:r1] * xd[:, None])).sum(-1)
    return _by_rows(part, qs.shape[0])


def q5_0_matmul(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xq, xd, xs = quantize_q8_0(x)

    def part(r0: int, r1: int) -> torch.Tensor:
        dots = (_block_dots(xq, q5_0_values(qs[r0:r1], qh[r0:r1]), QK) - 16 * xs[:, None].double()).float()
        return (dots * (d[None, r0:r1] * xd[:, None])).sum(-1)
    return _by_rows(part, qs.shape[0])


def k4_matmul(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor | None, sc: torch.Tensor, mn: torch.Tensor,
              d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    xq, xd, xs = quantize_q8_k(x)
    tokens = x.shape[0]
    xs32 = xs.reshape(tokens, -1, 2).sum(-1).double()  # sums per sub-block of 32

    def part(r0: int, r1: int) -> torch.Tensor:
        u = k4_values(qs[r0:r1], None if qh is None else qh[r0:r1])
        dots = _block_dots(xq, u, QK).reshape(tokens, r1 - r0, -1, 8)
        isum = (dots * sc[r0:r1].double().reshape(r1 - r0, -1, 8)).sum(-1).float()
        mins = (mn[r0:r1].double().reshape(1, r1 - r0, -1, 8) * xs32.reshape(tokens, 1, -1, 8)).sum(-1).float()
        return (xd[:, None] * (d[None, r0:r1] * isum - dmin[None, r0:r1] * mins)).sum(-1)
    return _by_rows(part, qs.shape[0])


def q6_k_matmul(x: torch.Tensor, ql: torch.Tensor, qh: torch.Tensor, sc: torch.Tensor, d: torch.Tensor
                ) -> torch.Tensor:
    xq, xd, xs = quantize_q8_k(x)
    tokens = x.shape[0]

    def part(r0: int, r1: int) -> torch.Tensor:
        dots = _block_dots(xq, q6_k_values(ql[r0:r1], qh[r0:r1]), 16) - 32 * xs[:, None].double()
        isum = (dots * sc[None, r0:r1].double()).reshape(tokens, r1 - r0, -1, 16).sum(-1).float()
        return (xd[:, None] * d[None, r0:r1] * isum).sum(-1)
    return _by_rows(part, ql.shape[0])
