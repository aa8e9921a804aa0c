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
