"""RMSNorm, alone and with the residual add fused in; one program per row, fp32 math, one rounding at the end."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_HIDDEN = 65536  # one row lives in registers


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:  # the sum is rounded to the residual's dtype first, as `x + residual` in torch is
        r = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        r = r.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=mask)
        x = r
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            eps: float) -> None:
    rows, hidden = x.shape
    if x.stride(-1) != 1 or weight.shape != (hidden,) or hidden > _MAX_HIDDEN:
        raise ValueError(f"rms_norm needs x [tokens, hidden <= {_MAX_HIDDEN}] with unit column stride and "
                         f"weight [hidden]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # a placeholder pointer when there is no residual
    _rms_norm_kernel[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
                              ADD_RESIDUAL=residual is not None, BLOCK=block,
                              num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> new tensor x * rsqrt(mean(x^2) + eps) * weight (reference: F.rms_norm)."""
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x and x = rms_norm(residual), both in place; returns (x, residual)."""
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual must match x {tuple(x.shape)} with unit column stride")
    _launch(x, residual, weight, x, eps)
    return x, residual


@triton.jit
def _qk_norm_kernel(x_ptr, q_weight_ptr, k_weight_ptr, out_ptr, stride_token, stride_head, num_q_heads, num_heads,
                    head_dim, eps, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    mask = (heads < num_heads)[:, None] & (cols < head_dim)[None, :]
    x = tl.load(x_ptr + token * stride_token + heads[:, None] * stride_head + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 1) / head_dim + eps)
    col_ok = cols < head_dim
    w_q = tl.load(q_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    w_k = tl.load(k_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    w = tl.where((heads < num_q_heads)[:, None], w_q[None, :], w_k[None, :])
    out = x * inv_rms[:, None] * w
    tl.store(out_ptr + token * num_heads * head_dim + heads[:, None] * head_dim + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def qk_rms_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float) -> torch.Tensor:
    """Qwen3's per-head q and k norms in one launch: qk [T, q heads + k heads, head_dim] (a strided view of
    the fused qkv) -> a new contiguous tensor, q heads normed with q_weight, k heads with k_weight."""
    tokens, heads, head_dim = qk.shape
    if qk.stride(-1) != 1 or q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"qk_rms_norm needs qk [tokens, heads, head_dim] with unit column stride and weights "
                         f"[head_dim]; got qk {tuple(qk.shape)}, weights {tuple(q_weight.shape)}, "
                         f"{tuple(k_weight.shape)}")
    out = torch.empty(tokens, heads, head_dim, dtype=qk.dtype, device=qk.device)
    if tokens:
        _qk_norm_kernel[(tokens,)](qk, q_weight, k_weight, out, qk.stride(0), qk.stride(1), num_q_heads, heads,
                                   head_dim, eps, HEADS=triton.next_power_of_2(heads),
                                   BLOCK=triton.next_power_of_2(head_dim), num_warps=4)
    return out
