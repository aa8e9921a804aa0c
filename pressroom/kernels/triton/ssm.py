"""One-token decode steps of state-space layers on state pools, in place: Mamba2's SSD step (one program per
row, head and head_dim block), Mamba1's selective step and the causal conv update (one program per row and
channel block).

References: pressroom.kernels.ssm.ssd_state_update_pool, selective_state_update_pool and
causal_conv1d_update_pool. Row i of the batch steps
pool[slots[i]]; a negative slot (a CUDA-graph padding row) touches no state and its output stays zero. Math in
fp32; a state is rounded to its pool's dtype once, when it is stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.ssm import DT_LIMIT

_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: above it, softplus(x) == x


@triton.jit
def _ssd_state_update_kernel(state_ptr, slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
                             stride_s_slot, stride_s_head, stride_s_dim, stride_x_row, stride_x_head,
                             stride_dt_row, stride_b_row, stride_b_group, stride_y_row, stride_y_head,
                             head_dim, d_state, heads_per_group, dt_min, dt_max,
                             HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        states_n = tl.arange(0, BLOCK_N)
        dim_ok = dims < head_dim
        n_ok = states_n < d_state
        group = head // heads_per_group

        dt = tl.load(dt_ptr + row * stride_dt_row + head).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + head).to(tl.float32)
        if SOFTPLUS:
            dt = tl.where(dt > _SOFTPLUS_THRESHOLD, dt, tl.log(1.0 + tl.exp(dt)))
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        decay = tl.exp(dt * tl.load(A_ptr + head).to(tl.float32))

        x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + dims, mask=dim_ok, other=0.0)
        x = x.to(tl.float32)
        b_off = row * stride_b_row + group * stride_b_group + states_n
        B = tl.load(B_ptr + b_off, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + b_off, mask=n_ok, other=0.0).to(tl.float32)

        tile = (state_ptr + slot * stride_s_slot + head * stride_s_head + dims[:, None] * stride_s_dim
                + states_n[None, :])
        tile_ok = dim_ok[:, None] & n_ok[None, :]
        h = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32)
        h = decay * h + (dt * x)[:, None] * B[None, :]
        tl.store(tile, h.to(state_ptr.dtype.element_ty), mask=tile_ok)

        y = tl.sum(h * C[None, :], 1)
        if HAS_D:
            y += tl.load(D_ptr + head).to(tl.float32) * x
        tl.store(y_ptr + row * stride_y_row + head * stride_y_head + dims, y.to(y_ptr.dtype.element_ty),
                 mask=dim_ok)


def ssd_state_update_pool(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                          A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                          dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                          dt_limit: tuple[float, float] = DT_LIMIT) -> torch.Tensor:
    """states [num_slots, heads, head_dim, d_state] stepped in place at slots [batch]; x [batch, heads, head_dim];
    dt [batch, heads]; A, D, dt_bias [heads]; B, C [batch, n_groups, d_state]. Returns y [batch, heads, head_dim]
    (zeros on padding rows)."""
    batch, heads, head_dim = x.shape
    d_state = states.shape[-1]
    n_groups = B.shape[1]
    _check(states, x, dt, B, C, heads, n_groups)
    y = torch.zeros_like(x)
    if batch == 0:
        return y
    block_p = min(triton.next_power_of_2(head_dim), 64)
    block_n = triton.next_power_of_2(d_state)
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssd_state_update_kernel[grid](
        states, slots, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, y,
        states.stride(0), states.stride(1), states.stride(2), x.stride(0), x.stride(1),
        dt.stride(0), B.stride(0), B.stride(1), y.stride(0), y.stride(1),
        head_dim, d_state, heads // n_groups, float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return y


def _check(states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, heads: int,
           n_groups: int) -> None:
    """The kernel addresses the innermost dim of each tensor with unit stride and B, C with one set of strides."""
    unit = all(t.stride(-1) == 1 for t in (states, x, dt, B, C))
    if not unit or B.stride() != C.stride() or heads % n_groups or states.shape[1:3] != x.shape[1:]:
        raise ValueError(f"ssd_state_update_pool: states {tuple(states.shape)}, x {tuple(x.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}: needs unit inner strides, B and C laid out "
                         "alike, heads divisible by n_groups and states [slots, heads, head_dim, d_state]")


@triton.jit
def _selective_update_kernel(state_ptr, slot_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr,
                             y_ptr, d_inner, d_state, stride_s_slot, stride_s_channel, stride_x_row, stride_dt_row,
                             stride_a_channel, stride_b_row, stride_c_row, stride_z_row, stride_y_row,
                             HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                             SOFTPLUS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        states_n = tl.arange(0, BLOCK_N)
        chan_ok = chans < d_inner
        tile_ok = chan_ok[:, None] & (states_n < d_state)[None, :]

        dt = tl.load(dt_ptr + row * stride_dt_row + chans, mask=chan_ok, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
        if SOFTPLUS:
            dt = tl.where(dt > _SOFTPLUS_THRESHOLD, dt, tl.log(1.0 + tl.exp(dt)))
        x = tl.load(x_ptr + row * stride_x_row + chans, mask=chan_ok, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + chans[:, None] * stride_a_channel + states_n[None, :], mask=tile_ok, other=0.0)
        B = tl.load(B_ptr + row * stride_b_row + states_n, mask=states_n < d_state, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + row * stride_c_row + states_n, mask=states_n < d_state, other=0.0).to(tl.float32)

        tile = state_ptr + slot * stride_s_slot + chans[:, None] * stride_s_channel + states_n[None, :]
        h = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A.to(tl.float32)) * h + (dt * x)[:, None] * B[None, :]
        tl.store(tile, h.to(state_ptr.dtype.element_ty), mask=tile_ok)

        y = tl.sum(h * C[None, :], 1)
        if HAS_D:
            y += tl.load(D_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32) * x
        if HAS_Z:
            z = tl.load(z_ptr + row * stride_z_row + chans, mask=chan_ok, other=0.0).to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + row * stride_y_row + chans, y.to(y_ptr.dtype.element_ty), mask=chan_ok)


def selective_state_update_pool(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                                A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                                z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                dt_softplus: bool = True) -> torch.Tensor:
    """states [num_slots, d_inner, d_state] stepped in place at slots [batch]; x, dt, z [batch, d_inner];
    A [d_inner, d_state]; B, C [batch, d_state]; D, dt_bias [d_inner]. Returns y [batch, d_inner] (zeros on
    padding rows)."""
    batch, d_inner = x.shape
    d_state = states.shape[-1]
    if (states.shape[1:] != A.shape or A.shape[0] != d_inner
            or any(t.stride(-1) != 1 for t in (states, x, dt, A, B, C) + (() if z is None else (z,)))):
        raise ValueError(f"selective_state_update_pool: states {tuple(states.shape)}, x {tuple(x.shape)}, "
                         f"A {tuple(A.shape)}: needs states [slots, d_inner, d_state] matching A, unit inner strides")
    y = torch.zeros_like(x)
    if batch == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    block_d = max(1, min(triton.next_power_of_2(d_inner), 4096 // block_n))
    zz = x if z is None else z  # a placeholder pointer when there is no gate
    _selective_update_kernel[(batch, triton.cdiv(d_inner, block_d))](
        states, slots, x, dt, A, B, C, A if D is None else D, zz, A if dt_bias is None else dt_bias, y,
        d_inner, d_state, states.stride(0), states.stride(1), x.stride(0), dt.stride(0), A.stride(0),
        B.stride(0), C.stride(0), zz.stride(0), y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4)
    return y


@triton.jit
def _conv_update_kernel(state_ptr, slot_ptr, x_ptr, weight_ptr, bias_ptr, y_ptr, channels,
                        stride_s_slot, stride_s_channel, stride_x_row, stride_w_channel, stride_y_row,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        taps = tl.arange(0, BLOCK_W)
        chan_ok = chans < channels
        state_row = state_ptr + slot * stride_s_slot + chans[:, None] * stride_s_channel
        x = tl.load(x_ptr + row * stride_x_row + chans, mask=chan_ok, other=0.0).to(tl.float32)
        # the window, oldest first: the w-1 stored inputs then this token's
        in_state = chan_ok[:, None] & (taps[None, :] < WIDTH - 1)
        window = tl.load(state_row + taps[None, :], mask=in_state, other=0.0).to(tl.float32)
        window = tl.where(taps[None, :] == WIDTH - 1, x[:, None], window)
        # the next state is the window shifted by one: read it before anything is stored
        shifted_in_state = chan_ok[:, None] & (taps[None, :] < WIDTH - 2)
        shifted = tl.load(state_row + taps[None, :] + 1, mask=shifted_in_state, other=0.0).to(tl.float32)
        shifted = tl.where(taps[None, :] == WIDTH - 2, x[:, None], shifted)

        w = tl.load(weight_ptr + chans[:, None] * stride_w_channel + taps[None, :],
                    mask=chan_ok[:, None] & (taps[None, :] < WIDTH), other=0.0).to(tl.float32)
        y = tl.sum(window * w, 1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(state_row + taps[None, :], shifted.to(state_ptr.dtype.element_ty),
                 mask=chan_ok[:, None] & (taps[None, :] < WIDTH - 1))
        tl.store(y_ptr + row * stride_y_row + chans, y.to(y_ptr.dtype.element_ty), mask=chan_ok)


def causal_conv1d_update_pool(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """x [batch, channels]; conv_states [num_slots, channels, w-1] shifted in place at slots [batch];
    weight [channels, w]. Returns y [batch, channels] (zeros on padding rows)."""
    batch, channels = x.shape
    width = weight.shape[1]
    if (conv_states.shape[1:] != (channels, width - 1) or width < 2 or weight.shape[0] != channels
            or any(t.stride(-1) != 1 for t in (x, conv_states, weight))):
        raise ValueError(f"causal_conv1d_update_pool: x {tuple(x.shape)}, conv_states {tuple(conv_states.shape)}, "
                         f"weight {tuple(weight.shape)}: needs conv_states [slots, channels, w-1] and weight "
                         "[channels, w >= 2], unit inner strides")
    y = torch.zeros_like(x)
    if batch == 0:
        return y
    block_c = min(triton.next_power_of_2(channels), 256)
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        conv_states, slots, x, weight, weight if bias is None else bias, y, channels,
        conv_states.stride(0), conv_states.stride(1), x.stride(0), weight.stride(0), y.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(width), num_warps=4)
    return y
