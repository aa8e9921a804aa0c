"""LoRA updates gathered by each token's adapter slot (Punica's BGMV): out[t] += B_k (A_k x[t]) with k the token's
slot, reading only that slot's A and B. For steps of few tokens (decodes) this reads a sliver of what the all-slots
product (lora/layers.py) reads, in three launches a layer: a zeroed fp32 buffer, the shrink (split along the input
features, summed atomically) and the expand (added into the output in place). Slot -1 (the base model) adds nothing.

Layout (lora/layers.py's LoRASlots): a [slots * width, in], b [out, slots * width]; slot k's rows of a and columns of b
at [k * width, (k + 1) * width), the adapter's scaling folded into b.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_K_CHUNK = 512  # input features one shrink program sums (a 4,096-wide layer: 8 programs a token)
_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, s_ptr, stride_x, stride_a, stride_s, in_features, width,
                   K_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        rows = tl.arange(0, BLOCK_W)
        row_mask = rows < width
        a_rows = a_ptr + (slot * width + rows).to(tl.int64)[:, None] * stride_a
        acc = tl.zeros([BLOCK_W], dtype=tl.float32)
        for k in range(0, K_CHUNK, BLOCK_K):
            cols = chunk * K_CHUNK + k + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            x = tl.load(x_ptr + t * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        tl.store(s_ptr + t * stride_s + chunk * BLOCK_W + rows, acc, mask=row_mask)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slots_ptr, out_ptr, stride_s, stride_b, stride_o, out_features, width, chunks,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        w = tl.arange(0, BLOCK_W)
        w_mask = w < width
        s = tl.zeros([BLOCK_W], dtype=tl.float32)
        for c in range(0, chunks):  # the shrink's partial sums, one per chunk of the input features
            s += tl.load(s_ptr + t * stride_s + c * BLOCK_W + w, mask=w_mask, other=0.0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < out_features
        b = tl.load(b_ptr + n.to(tl.int64)[:, None] * stride_b + (slot * width + w)[None, :],
                    mask=n_mask[:, None] & w_mask[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * s[None, :], axis=1)
        o = tl.load(out_ptr + t * stride_o + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + n, (o + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def add_lora_updates(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     token_slots: torch.Tensor, width: int) -> None:
    """out [T, out_features] += each token's slot's B (A x) in place; x [T, in_features]; token_slots [T] (-1: none)."""
    tokens, in_features = x.shape
    if tokens == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("add_lora_updates needs unit column strides for out, a and b.")
    block_w = max(16, triton.next_power_of_2(width))
    chunks = triton.cdiv(in_features, _K_CHUNK)
    partials = torch.empty(tokens, chunks * block_w, dtype=torch.float32, device=x.device)  # [T, chunk, width]
    _shrink_kernel[(tokens, chunks)](
        x, a, token_slots, partials, x.stride(0), a.stride(0), partials.stride(0), in_features, width,
        K_CHUNK=_K_CHUNK, BLOCK_K=_BLOCK_K, BLOCK_W=block_w, num_warps=4)
    _expand_kernel[(tokens, triton.cdiv(out.shape[1], _BLOCK_N))](
        partials, b, token_slots, out, partials.stride(0), b.stride(0), out.stride(0), out.shape[1], width, chunks,
        BLOCK_N=_BLOCK_N, BLOCK_W=block_w, num_warps=4)
