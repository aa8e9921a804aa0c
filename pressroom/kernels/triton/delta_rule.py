"""The gated delta rule's fused decode step: one token per sequence, each sequence's state in a slot of a state pool
[num_slots, H_v, d_k, d_v], updated in place. Reference: pressroom.kernels.delta_rule.recurrent_decode_step (the
recurrence and the layouts are in that module's docstring).

One program per (sequence, value head, block of d_v columns): the state's columns are independent in the delta rule
(the read S^T k and the update k delta^T act column by column), so a block of columns needs all of q and k and
nothing from other blocks. q/k normalization, the gate, the read, the update and the output are fused; fp32 math.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.delta_rule import L2NORM_EPS

_BLOCK_V = 32  # d_v columns per program: 128 x 32 fp32 state tile in registers, and H_v * d_v / 32 programs a token
_MAX_HEAD_DIM = 256


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slot_ptr, out_ptr,
                   stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh,
                   stride_bn, stride_bh, stride_ps, stride_ph, stride_pk, stride_on, stride_oh,
                   group, d_k, d_v, scale, eps,
                   NORMALIZE_QK: tl.constexpr, SCALAR_GATE: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    live = slot >= 0  # a negative slot is a padding entry: nothing is read or written but a zero output
    row_ok = rows < d_k
    col_ok = (cols < d_v) & live
    key_head = head // group
    q = tl.load(q_ptr + seq * stride_qn + key_head * stride_qh + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_kn + key_head * stride_kh + rows, mask=row_ok, other=0.0).to(tl.float32)
    if NORMALIZE_QK:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    q = q * scale
    if SCALAR_GATE:
        decay = tl.exp(tl.load(g_ptr + seq * stride_gn + head * stride_gh).to(tl.float32))
    else:
        decay = tl.exp(tl.load(g_ptr + seq * stride_gn + head * stride_gh + rows, mask=row_ok, other=0.0)
                       .to(tl.float32))[:, None]
    beta = tl.load(beta_ptr + seq * stride_bn + head * stride_bh).to(tl.float32)
    v = tl.load(v_ptr + seq * stride_vn + head * stride_vh + cols, mask=col_ok, other=0.0).to(tl.float32)

    tile = tl.maximum(slot, 0) * stride_ps + head * stride_ph + rows[:, None] * stride_pk + cols[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    state = tl.load(pool_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32) * decay
    delta = (v - tl.sum(state * k[:, None], 0)) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(pool_ptr + tile, state.to(pool_ptr.dtype.element_ty), mask=tile_ok)
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + seq * stride_on + head * stride_oh + cols, out.to(out_ptr.dtype.element_ty),
             mask=cols < d_v)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state_pool: torch.Tensor, slots: torch.Tensor) -> None:
    n, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    gate_ok = g.shape in ((n, h_v), (n, h_v, d_k))
    if (q.shape != k.shape or v.shape[0] != n or h_v % h_k or not gate_ok or beta.shape != (n, h_v)
            or state_pool.shape[1:] != (h_v, d_k, d_v) or slots.shape != (n,) or d_k > _MAX_HEAD_DIM):
        raise ValueError(f"delta rule decode: q, k [N, H_k, d_k <= {_MAX_HEAD_DIM}], v [N, H_v, d_v], g [N, H_v] "
                         f"or [N, H_v, d_k], beta [N, H_v], state_pool [slots, H_v, d_k, d_v], slots [N]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                         f"{tuple(beta.shape)}, state_pool {tuple(state_pool.shape)}, slots {tuple(slots.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, state_pool)):
        raise ValueError("delta rule decode: q, k, v, g and state_pool need a unit stride in their last dim")


def fused_recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state_pool: torch.Tensor, slots: torch.Tensor, normalize_qk: bool = True,
                           scale: float | None = None) -> torch.Tensor:
    """One token of each of N sequences: q, k [N, H_k, d_k], v [N, H_v, d_v], g [N, H_v] (GDN) or [N, H_v, d_k]
    (KDA), beta [N, H_v]; sequence n's state is state_pool[slots[n]], advanced in place (a negative slot is
    padding: untouched, zero output). Returns o [N, H_v, d_v] in v's dtype."""
    _check(q, k, v, g, beta, state_pool, slots)
    n, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n == 0:
        return out
    grid = (n, h_v, triton.cdiv(d_v, _BLOCK_V))
    _decode_kernel[grid](q, k, v, g, beta, state_pool, slots, out,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
                         state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
                         out.stride(0), out.stride(1),
                         h_v // h_k, d_k, d_v, scale if scale is not None else d_k ** -0.5, L2NORM_EPS,
                         NORMALIZE_QK=normalize_qk, SCALAR_GATE=g.dim() == 2,
                         BLOCK_K=triton.next_power_of_2(d_k), BLOCK_V=_BLOCK_V, num_warps=4)
    return out
