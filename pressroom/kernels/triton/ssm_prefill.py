"""Prefill of state-space layers over packed sequences, each sequence continuing from (and leaving its final state
in) a slot of a state pool: the causal conv, Mamba1's selective scan and Mamba2's SSD.

References: pressroom.kernels.ssm.causal_conv1d_varlen, selective_scan_varlen and ssd_varlen (the recurrences and
layouts are in that module's docstring). Sequence i holds tokens cu_seqlens[i]:cu_seqlens[i+1] and the state
pool[slots[i]]; a negative slot is padding (its tokens come out as zeros, no state is touched), and so is an empty
sequence's state untouched. Math in fp32; a state is rounded to its pool's dtype once, when it is stored.

- Causal conv: the outputs in parallel over (token block, channel block), each token reading its window from x or,
  before its sequence's start, from the conv state; then, once every output has read the old states, a second
  kernel writes the new ones (the last w-1 inputs of each sequence).
- Selective scan (Mamba1): one program per (sequence, channel block) walks the sequence in blocks of tokens; within a
  block the linear recurrence h_t = a_t h_{t-1} + b_t is an associative scan over [tokens, channels, d_state].
- SSD (Mamba2): one program per (sequence, head, head_dim block) walks the sequence in 64-token chunks with the
  state tile in registers: the chunk's quadratic form plus the carried state's contribution, then the state passed
  on. The chunking is exact, so its length (64, not ssm.SSD_CHUNK_SIZE) changes only rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.ssm import DT_LIMIT

_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: above it, softplus(x) == x
_SSD_CHUNK = 64
_SCAN_BLOCK_T = 16  # Mamba1: tokens per associative scan ([tokens, channels, d_state] fp32 tiles)
_SCAN_TILE = 8192  # Mamba1: elements of one such tile, which sets the channels per program
_CONV_BLOCK_T = 32
_MAX_D_STATE = 256


@triton.jit
def _time_step(dt, bias, SOFTPLUS: tl.constexpr):
    """dt + bias, through softplus when asked (ssm._time_step without the clamp)."""
    dt = dt + bias
    if SOFTPLUS:
        dt = tl.where(dt > _SOFTPLUS_THRESHOLD, dt, tl.log(1.0 + tl.exp(dt)))
    return dt


def _sequence_of_tokens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """seq[t]: the sequence token t belongs to (int32, on cu_seqlens' device, without reading it on the host)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, tokens, right=True) - 1).to(torch.int32)


def _precision(x: torch.Tensor) -> str:
    """Exact fp32 dots for fp32 inputs, TF32 for 16-bit ones (whose own rounding is coarser)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------- causal conv1d

@triton.jit
def _conv_kernel(x_ptr, seq_ptr, cu_ptr, slot_ptr, state_ptr, weight_ptr, bias_ptr, y_ptr, num_tokens, channels,
                 stride_xt, stride_ss, stride_sc, stride_wc, stride_yt,
                 WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_ok = tokens < num_tokens
    chan_ok = chans < channels
    seq = tl.load(seq_ptr + tokens, mask=token_ok, other=0)
    bos = tl.load(cu_ptr + seq, mask=token_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + seq, mask=token_ok, other=-1).to(tl.int64)
    live = token_ok & (slot >= 0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        src = tokens - (WIDTH - 1) + tap  # this tap's input; before the sequence's start it is in the conv state
        from_x = (live & (src >= bos))[:, None] & chan_ok[None, :]
        from_state = (live & (src < bos))[:, None] & chan_ok[None, :]
        u = tl.load(x_ptr + src[:, None] * stride_xt + chans[None, :], mask=from_x, other=0.0).to(tl.float32)
        state_col = src - bos + (WIDTH - 1)
        u += tl.load(state_ptr + tl.maximum(slot, 0)[:, None] * stride_ss + chans[None, :] * stride_sc
                     + state_col[:, None], mask=from_state, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + chans * stride_wc + tap, mask=chan_ok, other=0.0).to(tl.float32)
        acc += u * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    acc = tl.where(live[:, None], acc, 0.0)
    tl.store(y_ptr + tokens[:, None] * stride_yt + chans[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=token_ok[:, None] & chan_ok[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, cu_ptr, slot_ptr, state_ptr, channels, stride_xt, stride_ss, stride_sc,
                       WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    seq = tl.program_id(0)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    if (slot >= 0) & (eos > bos):
        chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols = tl.arange(0, BLOCK_W)
        chan_ok = chans < channels
        # the new state's column j is input eos - (w-1) + j: from x, or from the old state if the sequence is short
        src = eos - (WIDTH - 1) + cols
        col_ok = cols < WIDTH - 1
        from_x = chan_ok[:, None] & (col_ok & (src >= bos))[None, :]
        from_state = chan_ok[:, None] & (col_ok & (src < bos))[None, :]
        row = state_ptr + slot * stride_ss + chans[:, None] * stride_sc
        new = tl.load(x_ptr + src[None, :] * stride_xt + chans[:, None], mask=from_x, other=0.0).to(tl.float32)
        new += tl.load(row + (src - bos + (WIDTH - 1))[None, :], mask=from_state, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every thread has read the old state before any overwrites it
        tl.store(row + cols[None, :], new.to(state_ptr.dtype.element_ty), mask=chan_ok[:, None] & col_ok[None, :])


def causal_conv1d_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, conv_states: torch.Tensor, slots: torch.Tensor,
                         silu: bool = True) -> torch.Tensor:
    """Packed prefill: x [num_tokens, channels], weight [channels, w]; sequence i reads and writes
    conv_states[slots[i]] (the pool is [num_slots, channels, w-1]). Returns y [num_tokens, channels]."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    if (conv_states.shape[1:] != (channels, width - 1) or width < 2 or weight.shape[0] != channels
            or slots.shape != (num_seqs,) or any(t.stride(-1) != 1 for t in (x, conv_states, weight))):
        raise ValueError(f"causal_conv1d_varlen: x {tuple(x.shape)}, conv_states {tuple(conv_states.shape)}, weight "
                         f"{tuple(weight.shape)}, slots {tuple(slots.shape)}, cu_seqlens {tuple(cu_seqlens.shape)}: "
                         "needs conv_states [slots, channels, w-1], weight [channels, w >= 2], one slot a sequence "
                         "and unit inner strides")
    y = torch.empty_like(x)
    if num_tokens == 0 or num_seqs == 0:
        return y.zero_()
    block_c = min(triton.next_power_of_2(channels), 128)
    _conv_kernel[(triton.cdiv(num_tokens, _CONV_BLOCK_T), triton.cdiv(channels, block_c))](
        x, _sequence_of_tokens(cu_seqlens, num_tokens), cu_seqlens, slots, conv_states, weight,
        weight if bias is None else bias, y, num_tokens, channels,
        x.stride(0), conv_states.stride(0), conv_states.stride(1), weight.stride(0), y.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=_CONV_BLOCK_T, BLOCK_C=block_c, num_warps=4)
    state_block_c = min(triton.next_power_of_2(channels), 256)
    _conv_state_kernel[(num_seqs, triton.cdiv(channels, state_block_c))](
        x, cu_seqlens, slots, conv_states, channels, x.stride(0), conv_states.stride(0), conv_states.stride(1),
        WIDTH=width, BLOCK_C=state_block_c, BLOCK_W=max(2, triton.next_power_of_2(width - 1)), num_warps=4)
    return y


# ---------------------------------------------------------------- Mamba1 selective scan

@triton.jit
def _linear_recurrence(a1, b1, a2, b2):
    """Composes h -> a1 h + b1 then h -> a2 h + b2."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _selective_scan_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, cu_ptr, slot_ptr,
                           state_ptr, y_ptr, d_inner, d_state, stride_xt, stride_dtt, stride_a, stride_bt, stride_ct,
                           stride_zt, stride_yt, stride_ss, stride_sd,
                           HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                           SOFTPLUS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    if (slot >= 0) & (eos > bos):
        chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ns = tl.arange(0, BLOCK_N)
        steps = tl.arange(0, BLOCK_T)
        chan_ok = chans < d_inner
        n_ok = ns < d_state
        tile_ok = chan_ok[:, None] & n_ok[None, :]
        A = tl.load(A_ptr + chans[:, None] * stride_a + ns[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        dt_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_DT_BIAS:
            dt_bias = tl.load(dt_bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
        state_tile = state_ptr + slot * stride_ss + chans[:, None] * stride_sd + ns[None, :]
        h = tl.load(state_tile, mask=tile_ok, other=0.0).to(tl.float32)
        for block in range(0, tl.cdiv(eos - bos, BLOCK_T).to(tl.int32)):  # an int32 loop; offsets stay int64
            start = bos + block * BLOCK_T
            tokens = start + steps
            token_ok = tokens < eos
            ok = token_ok[:, None] & chan_ok[None, :]
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + chans[None, :], mask=ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + tokens[:, None] * stride_dtt + chans[None, :], mask=ok, other=0.0).to(tl.float32)
            dt = tl.where(ok, _time_step(dt, dt_bias[None, :], SOFTPLUS), 0.0)  # past the end: h passes unchanged
            bn_ok = token_ok[:, None] & n_ok[None, :]
            B = tl.load(B_ptr + tokens[:, None] * stride_bt + ns[None, :], mask=bn_ok, other=0.0).to(tl.float32)
            C = tl.load(C_ptr + tokens[:, None] * stride_ct + ns[None, :], mask=bn_ok, other=0.0).to(tl.float32)
            # [T, D * N]: a 2D scan along the tokens (3D scans are less travelled ground in Triton's lowering)
            decay = tl.reshape(tl.exp(dt[:, :, None] * A[None, :, :]), [BLOCK_T, BLOCK_D * BLOCK_N])
            inject = tl.reshape((dt * x)[:, :, None] * B[:, None, :], [BLOCK_T, BLOCK_D * BLOCK_N])
            decay, inject = tl.associative_scan((decay, inject), 0, _linear_recurrence)
            hs = tl.reshape(inject + decay * tl.reshape(h, [1, BLOCK_D * BLOCK_N]), [BLOCK_T, BLOCK_D, BLOCK_N])
            y = tl.sum(hs * C[:, None, :], 2)
            h = tl.sum(tl.where((steps == BLOCK_T - 1)[:, None, None], hs, 0.0), 0)
            if HAS_D:
                y += tl.load(D_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :] * x
            if HAS_Z:
                z = tl.load(z_ptr + tokens[:, None] * stride_zt + chans[None, :], mask=ok, other=0.0)
                z = z.to(tl.float32)
                y = y * z / (1.0 + tl.exp(-z))
            tl.store(y_ptr + tokens[:, None] * stride_yt + chans[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(state_tile, h.to(state_ptr.dtype.element_ty), mask=tile_ok)


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                          dt_bias: torch.Tensor | None = None, dt_softplus: bool = True) -> torch.Tensor:
    """Packed Mamba1 prefill: x, dt, z [num_tokens, d_inner], A [d_inner, d_state], B, C [num_tokens, d_state],
    D, dt_bias [d_inner]; sequence i starts from states[slots[i]] and leaves its final state there (pool
    [num_slots, d_inner, d_state]). Returns y [num_tokens, d_inner]."""
    num_tokens, d_inner = x.shape
    d_state = A.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    tensors = (x, dt, A, B, C, states) + (() if z is None else (z,))
    if (states.shape[1:] != A.shape or A.shape[0] != d_inner or dt.shape != x.shape or B.shape != (num_tokens, d_state)
            or C.shape != B.shape or slots.shape != (num_seqs,) or d_state > _MAX_D_STATE
            or any(t.stride(-1) != 1 for t in tensors)):
        raise ValueError(f"selective_scan_varlen: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B "
                         f"{tuple(B.shape)}, C {tuple(C.shape)}, states {tuple(states.shape)}, slots "
                         f"{tuple(slots.shape)}: needs states [slots, d_inner, d_state <= {_MAX_D_STATE}] matching A, "
                         "B and C [tokens, d_state], one slot a sequence and unit inner strides")
    y = torch.zeros_like(x)
    if num_tokens == 0 or num_seqs == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    block_d = max(1, min(triton.next_power_of_2(d_inner), _SCAN_TILE // (block_n * _SCAN_BLOCK_T)))
    zz = x if z is None else z  # a placeholder pointer when there is no gate
    _selective_scan_kernel[(num_seqs, triton.cdiv(d_inner, block_d))](
        x, dt, A, B, C, A if D is None else D, zz, A if dt_bias is None else dt_bias, cu_seqlens, slots, states, y,
        d_inner, d_state, x.stride(0), dt.stride(0), A.stride(0), B.stride(0), C.stride(0), zz.stride(0),
        y.stride(0), states.stride(0), states.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        BLOCK_T=_SCAN_BLOCK_T, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4)
    return y


# ---------------------------------------------------------------- Mamba2 SSD

@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, cu_ptr, slot_ptr, state_ptr, y_ptr,
                head_dim, d_state, heads_per_group, dt_min, dt_max,
                stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg, stride_yt, stride_yh,
                stride_ss, stride_sh, stride_sp,
                HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                DOT_PRECISION: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    if (slot >= 0) & (eos > bos):
        dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        ns = tl.arange(0, BLOCK_N)
        rows = tl.arange(0, CHUNK)
        dim_ok = dims < head_dim
        n_ok = ns < d_state
        group = head // heads_per_group
        A = tl.load(A_ptr + head).to(tl.float32)
        dt_bias = 0.0
        if HAS_DT_BIAS:
            dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        state_tile = state_ptr + slot * stride_ss + head * stride_sh + dims[:, None] * stride_sp + ns[None, :]
        state_ok = dim_ok[:, None] & n_ok[None, :]
        h = tl.load(state_tile, mask=state_ok, other=0.0).to(tl.float32)
        for chunk in range(0, tl.cdiv(eos - bos, CHUNK).to(tl.int32)):  # an int32 loop; offsets stay int64
            start = bos + chunk * CHUNK
            tokens = start + rows
            row_ok = tokens < eos
            dt = tl.load(dt_ptr + tokens * stride_dtt + head, mask=row_ok, other=0.0).to(tl.float32)
            dt = tl.minimum(tl.maximum(_time_step(dt, dt_bias, SOFTPLUS), dt_min), dt_max)
            dt = tl.where(row_ok, dt, 0.0)  # past the end: no decay, no input
            cum = tl.cumsum(dt * A, 0)  # log decay from the chunk's start through each token
            cum_last = tl.sum(tl.where(rows == CHUNK - 1, cum, 0.0), 0)
            x_ok = row_ok[:, None] & dim_ok[None, :]
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + head * stride_xh + dims[None, :], mask=x_ok, other=0.0)
            x = x.to(tl.float32)
            bc_ok = row_ok[:, None] & n_ok[None, :]
            B = tl.load(B_ptr + tokens[:, None] * stride_bt + group * stride_bg + ns[None, :], mask=bc_ok, other=0.0)
            C = tl.load(C_ptr + tokens[:, None] * stride_ct + group * stride_cg + ns[None, :], mask=bc_ok, other=0.0)
            B = B.to(tl.float32)
            C = C.to(tl.float32)
            # masked before exp: above the diagonal the exponent is positive and could overflow
            causal = rows[:, None] >= rows[None, :]
            decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], -float("inf")))
            scores = tl.dot(C, tl.trans(B), input_precision=DOT_PRECISION) * decay * dt[None, :]
            y = tl.dot(scores, x, input_precision=DOT_PRECISION)
            y += tl.dot(C, tl.trans(h), input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
            if HAS_D:
                y += tl.load(D_ptr + head).to(tl.float32) * x
            tl.store(y_ptr + tokens[:, None] * stride_yt + head * stride_yh + dims[None, :],
                     y.to(y_ptr.dtype.element_ty), mask=x_ok)
            to_end = dt * tl.exp(cum_last - cum)  # <= dt: cum only falls along the chunk
            h = h * tl.exp(cum_last) + tl.dot(tl.trans(x * to_end[:, None]), B, input_precision=DOT_PRECISION)
        tl.store(state_tile, h.to(state_ptr.dtype.element_ty), mask=state_ok)


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, D: torch.Tensor | None = None,
               dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = DT_LIMIT) -> torch.Tensor:
    """Packed Mamba2 prefill: x [num_tokens, heads, head_dim], dt [num_tokens, heads], A, D, dt_bias [heads],
    B, C [num_tokens, n_groups, d_state]; sequence i starts from states[slots[i]] and leaves its final state there
    (pool [num_slots, heads, head_dim, d_state]). Returns y [num_tokens, heads, head_dim]."""
    num_tokens, heads, head_dim = x.shape
    n_groups, d_state = B.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    if (states.shape[1:] != (heads, head_dim, d_state) or dt.shape != (num_tokens, heads) or heads % n_groups
            or B.shape[0] != num_tokens or C.shape != B.shape or slots.shape != (num_seqs,) or d_state > _MAX_D_STATE
            or any(t.stride(-1) != 1 for t in (x, dt, B, C, states))):
        raise ValueError(f"ssd_varlen: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, C "
                         f"{tuple(C.shape)}, states {tuple(states.shape)}, slots {tuple(slots.shape)}: needs states "
                         f"[slots, heads, head_dim, d_state <= {_MAX_D_STATE}], heads divisible by n_groups, one slot "
                         "a sequence and unit inner strides")
    y = torch.zeros_like(x)
    if num_tokens == 0 or num_seqs == 0:
        return y
    block_p = max(16, min(triton.next_power_of_2(head_dim), 64))
    block_n = max(16, triton.next_power_of_2(d_state))
    _ssd_kernel[(num_seqs, heads, triton.cdiv(head_dim, block_p))](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, cu_seqlens, slots, states, y,
        head_dim, d_state, heads // n_groups, float(dt_limit[0]), float(dt_limit[1]),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), states.stride(0), states.stride(1), states.stride(2),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, DOT_PRECISION=_precision(x),
        CHUNK=_SSD_CHUNK, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return y
