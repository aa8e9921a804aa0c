"""Writing this step's keys and values into the paged KV cache (in its element type: the model's, or FP8
with a scale of 1, saturated at the format's largest value rather than overflowing to NaN)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                     LIMIT: tl.constexpr, HAS_VALUES: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row (CUDA graphs run fixed batch sizes)
        return
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    dst = slot * stride_cs + heads * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    if LIMIT > 0:
        k = tl.clamp(k.to(tl.float32), -LIMIT, LIMIT)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_VALUES:
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if LIMIT > 0:
            v = tl.clamp(v.to(tl.float32), -LIMIT, LIMIT)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def saturation_limit(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 cache type; 0 for the types a cast never overflows."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 else 0.0


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """Stores k, v [T, kv_heads, head_dim] (row stride free) at flat slots block * block_size + offset of
    kv_cache [2, blocks, block_size, kv_heads, head_dim]; rows whose slot is negative are skipped. A latent
    cache [1, blocks, block_size, 1, dim] takes k only (v None), into the first k.shape[-1] values of an entry."""
    latent = kv_cache.shape[0] == 1
    if not kv_cache.is_contiguous() or k.stride(-1) != 1 or (not latent and v.stride(-1) != 1):
        raise ValueError("write_kv needs a contiguous kv_cache and k, v with unit stride in head_dim")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    key_cache = kv_cache[0]
    value_cache, v = (key_cache, k) if latent else (kv_cache[1], v)
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_dim), LIMIT=saturation_limit(kv_cache.dtype), HAS_VALUES=not latent,
        num_warps=4)
