"""State-space layers in torch (CPU and CUDA, fp32 and bf16): the causal conv, Mamba1's selective scan, Mamba2's
SSD, Mamba2's gated RMSNorm, and whole Mamba1 / Mamba2 mixers from their weights.

Layouts are token-major, as the engine flattens a batch: x [batch, seqlen, channels], or [num_tokens, ...] packed
with `cu_seqlens` [num_seqs + 1] for the varlen entry points. Math is fp32 inside; outputs take the input's dtype,
states keep their own dtype.

Causal conv (depthwise, width w). The conv state holds the previous w-1 inputs of each channel, oldest first:
    conv_state [batch, channels, w-1]
    y[t, c] = act(bias[c] + sum_k weight[c, k] * u[t - (w-1) + k, c])   with u[<0] read from the conv state

Mamba1 selective scan, per channel d (d_inner of them) and state index n (d_state):
    dt = softplus(dt_raw + dt_bias)          A = -exp(A_log) [d_inner, d_state]
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t[n] * x_t       state h [batch, d_inner, d_state]
    y_t = sum_n C_t[n] * h_t[:, n] + D * x_t,   then  y_t * silu(z_t)

Mamba2 SSD: A is a scalar per head, so the decay is the same for the whole [head_dim, d_state] state of a head
and the scan has a quadratic "attention" form inside a chunk. B and C are shared by the heads of a group
(heads // n_groups heads each):
    a_t = dt_t * A[h]                         (log decay, <= 0)
    h_t = exp(a_t) * h_{t-1} + dt_t * x_t (outer) B_t       state h [batch, heads, head_dim, d_state]
    y_t = h_t @ C_t + D[h] * x_t
Chunked (length L): with the in-chunk cumulative sum s_l = a_1 + ... + a_l, the segment sum
seg[l, j] = a_{j+1} + ... + a_l = s_l - s_j (j <= l, else -inf; summed term by term for fp32) gives
    y_l = sum_{j<=l} exp(seg[l, j]) (C_l . B_j) dt_j x_j  +  exp(s_l) C_l . h_start        (intra + inter)
    h_end = exp(s_L) h_start + sum_j exp(s_L - s_j) dt_j x_j (outer) B_j                   (state passing)

The one-token steps update their states in place; the prefill functions take an initial state and return the
final one. The varlen functions read and write a state pool [num_slots, ...] at per-sequence slot indices.

On the CPU, Mamba1's scan and step and Mamba2's step run in C (kernels/csrc/recurrent.c through kernels/cpu.py)
where the tensors fit it (fp32 states, fp32 or bf16 activations); the torch code here is their reference and the
fallback, and `CPU_KERNELS = False` forces it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.kernels import cpu

CPU_KERNELS = True  # False: the torch forms below even where the C kernels fit (tests compare the two)
SSD_CHUNK_SIZE = 256
DT_LIMIT = (0.0, float("inf"))  # Mamba2's default clamp of dt after softplus: none in effect
SCAN_CHUNK_SIZE = 128  # Mamba1: tokens whose decays are materialized at once ([batch, L, d_inner, d_state] fp32)


# ---------------------------------------------------------------- causal conv1d

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor | None,
                  silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: x [batch, seqlen, channels], weight [channels, w], conv_state [batch, channels, w-1] (None: zeros).
    Returns (y [batch, seqlen, channels], the new conv state [batch, channels, w-1])."""
    batch, seqlen, channels = x.shape
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, channels, width - 1)
    u = torch.cat([conv_state.float(), x.transpose(1, 2).float()], dim=-1)  # [batch, channels, w-1+seqlen]
    y = F.conv1d(u, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=channels)
    if silu:
        y = F.silu(y)
    new_state = u[:, :, u.shape[-1] - (width - 1):].to(conv_state.dtype)
    return y.transpose(1, 2).to(x.dtype), new_state


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """One token: x [batch, channels]; conv_state [batch, channels, w-1] is shifted in place. Returns y [batch,
    channels]."""
    window = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], dim=-1)  # [batch, channels, w]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if silu:
        y = F.silu(y)
    conv_state.copy_(window[..., 1:])
    return y.to(x.dtype)


def causal_conv1d_update_pool(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """causal_conv1d_update on a pool [num_slots, channels, w-1]: row i shifts conv_states[slots[i]] in place; a
    negative slot is padding (zeros out, no state touched). The reference of the Triton kernel."""
    y = torch.zeros_like(x)
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel():
        picked = slots[rows].long()
        state = conv_states[picked]
        y[rows] = causal_conv1d_update(x[rows], state, weight, bias, silu)
        conv_states[picked] = state
    return y


def causal_conv1d_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, conv_states: torch.Tensor, slots: torch.Tensor,
                         silu: bool = True) -> torch.Tensor:
    """Packed prefill: x [num_tokens, channels]; sequence i reads and writes conv_states[slots[i]] (the pool is
    [num_slots, channels, w-1]). Tokens of padding sequences (slot < 0) come out as zeros."""
    y = torch.zeros_like(x)
    for part, slot in _spans(cu_seqlens, slots):
        out, state = causal_conv1d(x[None, part], weight, bias, conv_states[slot:slot + 1], silu)
        y[part] = out[0]
        conv_states[slot:slot + 1] = state
    return y


# ---------------------------------------------------------------- Mamba1 selective scan

def _on_c(states: torch.Tensor, buffered_dims: int, *tensors: torch.Tensor | None) -> bool:
    """This call goes to the C kernels: switched on, and they take its state pool and tensors."""
    return CPU_KERNELS and cpu.recurrent_fits(states, buffered_dims, *(t for t in tensors if t is not None))


def _time_step(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
               limit: tuple[float, float] | None = None) -> torch.Tensor:
    """dt in fp32 after its bias, softplus and clamp (Mamba2 clamps, Mamba1 does not): the one place the time step
    is discretized."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if limit is not None:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """D skip then silu(z) gate, fp32."""
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                   initial_state: torch.Tensor | None = None,
                   chunk_size: int = SCAN_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1 prefill. x, dt, z [batch, seqlen, d_inner]; A [d_inner, d_state]; B, C [batch, seqlen, d_state];
    initial_state [batch, d_inner, d_state] (None: zeros). Returns (y [batch, seqlen, d_inner], final state fp32).

    The decays and inputs of a chunk are computed at once; the recurrence then runs token by token over them."""
    batch, seqlen, d_inner = x.shape
    h = (x.new_zeros(batch, d_inner, A.shape[1], dtype=torch.float32) if initial_state is None
         else initial_state.float().clone(memory_format=torch.contiguous_format))
    if seqlen and _on_c(h, 1, x, dt, A, B, C, D, z, dt_bias):
        cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen)
        y = cpu.mamba1_scan(x.flatten(0, 1), dt.flatten(0, 1), A, B.flatten(0, 1), C.flatten(0, 1), D,
                            None if z is None else z.flatten(0, 1), dt_bias, dt_softplus, h, torch.arange(batch),
                            cu_seqlens)
        return y.view(batch, seqlen, d_inner), h
    dt = _time_step(dt, dt_bias, dt_softplus)
    A = A.float()
    ys = []
    for start in range(0, seqlen, chunk_size):
        end = min(start + chunk_size, seqlen)
        dt_c = dt[:, start:end, :, None]                                    # [batch, L, d_inner, 1]
        decay = torch.exp(dt_c * A)                                         # [batch, L, d_inner, d_state]
        inject = dt_c * B[:, start:end, None, :].float() * x[:, start:end, :, None].float()
        C_c = C[:, start:end].float()
        for t in range(end - start):
            h = decay[:, t] * h + inject[:, t]
            ys.append(torch.einsum("bdn,bn->bd", h, C_c[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(batch, 0, d_inner, dtype=torch.float32)
    return _gate(y, x, D, z).to(x.dtype), h


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = True) -> torch.Tensor:
    """Mamba1 one-token step. x, dt, z [batch, d_inner]; B, C [batch, d_state]; state [batch, d_inner, d_state]
    is updated in place. Returns y [batch, d_inner]."""
    if _on_c(state, 1, x, dt, A, B, C, D, z, dt_bias):
        return cpu.mamba1_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, state, torch.arange(x.shape[0]))
    dt = _time_step(dt, dt_bias, dt_softplus)[..., None]
    h = torch.exp(dt * A.float()) * state.float() + dt * B.float()[:, None, :] * x.float()[..., None]
    state.copy_(h)
    y = torch.einsum("bdn,bn->bd", h, C.float())
    return _gate(y, x, D, z).to(x.dtype)


def selective_state_update_pool(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                                A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                                z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                dt_softplus: bool = True) -> torch.Tensor:
    """selective_state_update on a pool [num_slots, d_inner, d_state]: row i steps states[slots[i]] in place; a
    negative slot is padding (zeros out, no state touched). The reference of the Triton and C kernels."""
    if _on_c(states, 1, x, dt, A, B, C, D, z, dt_bias):
        return cpu.mamba1_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, states, slots)
    y = torch.zeros_like(x)
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel():
        picked = slots[rows].long()
        state = states[picked].float()
        y[rows] = selective_state_update(state, x[rows], dt[rows], A, B[rows], C[rows], D,
                                         None if z is None else z[rows], dt_bias, dt_softplus)
        states[picked] = state.to(states.dtype)
    return y


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                          dt_bias: torch.Tensor | None = None, dt_softplus: bool = True) -> torch.Tensor:
    """Packed Mamba1 prefill: x, dt, z [num_tokens, d_inner], B, C [num_tokens, d_state]; sequence i starts from
    states[slots[i]] and leaves its final state there (pool [num_slots, d_inner, d_state])."""
    if _on_c(states, 1, x, dt, A, B, C, D, z, dt_bias):
        return cpu.mamba1_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, states, slots, cu_seqlens)
    y = torch.zeros_like(x)
    for part, slot in _spans(cu_seqlens, slots):
        out, h = selective_scan(x[None, part], dt[None, part], A, B[None, part], C[None, part], D,
                                None if z is None else z[None, part], dt_bias, dt_softplus, states[slot:slot + 1])
        y[part] = out[0]
        states[slot:slot + 1] = h
    return y


# ---------------------------------------------------------------- Mamba2 SSD

def _heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., n_groups, d_state] -> [..., heads, d_state]: each group's B or C serves heads // n_groups heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _segment_sum(log_decay: torch.Tensor) -> torch.Tensor:
    """seg[..., l, j] = a[j+1] + ... + a[l] for j <= l, -inf above the diagonal (exp of it is the causal decay).
    Summed term by term rather than as cumsum[l] - cumsum[j]: deep in a chunk both cumsums are large and their
    difference would lose the fp32 digits that the nearby (largest) decays need."""
    length = log_decay.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=log_decay.device)
    terms = log_decay[..., :, None].expand(*log_decay.shape, length).masked_fill(~ones.tril(-1), 0.0)
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                dt_limit: tuple[float, float] = DT_LIMIT, initial_state: torch.Tensor | None = None,
                chunk_size: int = SSD_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 prefill. x [batch, seqlen, heads, head_dim]; dt [batch, seqlen, heads]; A [heads];
    B, C [batch, seqlen, n_groups, d_state]; initial_state [batch, heads, head_dim, d_state] (None: zeros).
    Returns (y [batch, seqlen, heads, head_dim], final state fp32)."""
    batch, seqlen, heads, head_dim = x.shape
    d_state = B.shape[-1]
    dt = _time_step(dt, dt_bias, dt_softplus, dt_limit)
    pad = (-seqlen) % chunk_size
    chunks = (seqlen + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [batch, seqlen, ...] -> [batch, chunks, L, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    xdt = chunked(x.float() * dt[..., None])                               # [b, c, l, h, p]
    Bh = chunked(_heads_of_groups(B.float(), heads))                       # [b, c, l, h, n]
    Ch = chunked(_heads_of_groups(C.float(), heads))
    log_decay = chunked(dt * A.float()).permute(0, 1, 3, 2)                # [b, c, h, l]; padding decays by 1
    cumsum = log_decay.cumsum(-1)
    segment = _segment_sum(log_decay)                                      # [b, c, h, l, j]
    # intra-chunk: the quadratic form, masked by the causal decay
    scores = torch.einsum("bclhn,bcjhn->bchlj", Ch, Bh) * torch.exp(segment)
    y = torch.einsum("bchlj,bcjhp->bclhp", scores, xdt)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(segment[..., -1, :])                                # [b, c, h, l]
    chunk_states = torch.einsum("bchl,bclhn,bclhp->bchpn", to_end, Bh, xdt)
    # inter-chunk: pass the state along, one chunk at a time
    h = (x.new_zeros(batch, heads, head_dim, d_state, dtype=torch.float32) if initial_state is None
         else initial_state.float())
    chunk_decay = torch.exp(cumsum[..., -1])                               # [b, c, h]
    starts = []
    for c in range(chunks):
        starts.append(h)
        h = chunk_decay[:, c, :, None, None] * h + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)                              # [b, c, h, p, n]
    y = y + torch.einsum("bclhn,bchpn->bclhp", Ch, start_states) * torch.exp(cumsum).permute(0, 1, 3, 2)[..., None]
    y = y.reshape(batch, chunks * chunk_size, heads, head_dim)[:, :seqlen]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), h


def ssd_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                     dt_softplus: bool = True,
                     dt_limit: tuple[float, float] = DT_LIMIT) -> torch.Tensor:
    """Mamba2 one-token step. x [batch, heads, head_dim]; dt [batch, heads]; B, C [batch, n_groups, d_state];
    state [batch, heads, head_dim, d_state] is updated in place. Returns y [batch, heads, head_dim]."""
    if _on_c(state, 2, x, dt, A, B, C, D, dt_bias):
        return cpu.ssd_step(state, torch.arange(x.shape[0]), x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
    heads = x.shape[1]
    dt = _time_step(dt, dt_bias, dt_softplus, dt_limit)                   # [batch, heads]
    decay = torch.exp(dt * A.float())[..., None, None]
    Bh = _heads_of_groups(B.float(), heads)[:, :, None, :]                 # [batch, heads, 1, d_state]
    h = decay * state.float() + (dt[..., None] * x.float())[..., None] * Bh
    state.copy_(h)
    y = torch.einsum("bhpn,bhn->bhp", h, _heads_of_groups(C.float(), heads))
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def ssd_state_update_pool(states: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                          A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                          dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                          dt_limit: tuple[float, float] = DT_LIMIT) -> torch.Tensor:
    """ssd_state_update on a state pool [num_slots, heads, head_dim, d_state]: row i steps states[slots[i]] in
    place; a negative slot is padding (its output is zeros, no state is touched). The reference of the Triton and C
    kernels."""
    if _on_c(states, 2, x, dt, A, B, C, D, dt_bias):
        return cpu.ssd_step(states, slots, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
    y = torch.zeros_like(x)
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel():
        picked = slots[rows].long()
        state = states[picked]
        y[rows] = ssd_state_update(state, x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, dt_softplus, dt_limit)
        states[picked] = state.to(states.dtype)
    return y


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, D: torch.Tensor | None = None,
               dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = DT_LIMIT, chunk_size: int = SSD_CHUNK_SIZE) -> torch.Tensor:
    """Packed Mamba2 prefill: x [num_tokens, heads, head_dim], dt [num_tokens, heads], B, C [num_tokens, n_groups,
    d_state]; sequence i starts from states[slots[i]] and leaves its final state there."""
    y = torch.zeros_like(x)
    for part, slot in _spans(cu_seqlens, slots):
        out, h = ssd_chunked(x[None, part], dt[None, part], A, B[None, part], C[None, part], D, dt_bias,
                             dt_softplus, dt_limit, states[slot:slot + 1], chunk_size)
        y[part] = out[0]
        states[slot:slot + 1] = h
    return y


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   group_size: int) -> torch.Tensor:
    """Mamba2's norm: RMSNorm of x * silu(z) over groups of group_size channels (d_inner // n_groups), in fp32;
    rounded to x's dtype before the weight, as HF's Mamba2RMSNormGated does. Per group as mamba_ssm's Mamba2:
    older transformers (5.17, the GPU image's) normalize over all of d_inner, so differ wherever n_groups > 1."""
    h = x.float()
    if z is not None:
        h = h * F.silu(z.float())
    grouped = h.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.flatten(-2).to(x.dtype)


def _spans(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> list[tuple[slice, int]]:
    """(tokens, state slot) of each sequence of a packed batch; empty sequences and negative (padding) slots are
    skipped, their states untouched."""
    bounds, slot_ids = cu_seqlens.tolist(), slots.tolist()
    return [(slice(start, end), slot) for start, end, slot in zip(bounds[:-1], bounds[1:], slot_ids)
            if end > start and slot >= 0]


# ---------------------------------------------------------------- whole mixers from weights

@dataclass(frozen=True)
class Mamba1Weights:
    """One Mamba1 mixer. conv_weight [d_inner, w]; x_proj_weight [dt_rank + 2 d_state, d_inner];
    dt_proj_weight [d_inner, dt_rank]; A_log [d_inner, d_state]."""
    in_proj_weight: torch.Tensor
    in_proj_bias: torch.Tensor | None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    x_proj_weight: torch.Tensor
    dt_proj_weight: torch.Tensor
    dt_proj_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    out_proj_weight: torch.Tensor
    out_proj_bias: torch.Tensor | None


@dataclass(frozen=True)
class Mamba2Weights:
    """One Mamba2 mixer. in_proj gives [z (d_inner), xBC (d_inner + 2 n_groups d_state), dt (heads)];
    conv_weight [d_inner + 2 n_groups d_state, w]; A_log, D, dt_bias [heads]; norm_weight [d_inner]."""
    in_proj_weight: torch.Tensor
    in_proj_bias: torch.Tensor | None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor
    out_proj_weight: torch.Tensor
    out_proj_bias: torch.Tensor | None
    head_dim: int
    n_groups: int
    d_state: int
    norm_eps: float = 1e-6
    chunk_size: int = SSD_CHUNK_SIZE
    dt_limit: tuple[float, float] = DT_LIMIT


def mamba1_mixer_forward(hidden: torch.Tensor, w: Mamba1Weights, conv_state: torch.Tensor,
                         ssm_state: torch.Tensor) -> torch.Tensor:
    """hidden [batch, seqlen, hidden]; conv_state [batch, d_inner, w-1] and ssm_state [batch, d_inner, d_state]
    hold the state before this call and are updated in place (zeros for a fresh sequence). One token takes the
    step path, more the prefill path."""
    d_state = w.A_log.shape[1]
    dt_rank = w.dt_proj_weight.shape[1]
    x, z = F.linear(hidden, w.in_proj_weight, w.in_proj_bias).chunk(2, dim=-1)
    A = -torch.exp(w.A_log.float())
    if hidden.shape[1] == 1:
        x = causal_conv1d_update(x[:, 0], conv_state, w.conv_weight, w.conv_bias)
        dt, B, C = F.linear(x, w.x_proj_weight).split([dt_rank, d_state, d_state], dim=-1)
        y = selective_state_update(ssm_state, x, F.linear(dt, w.dt_proj_weight), A, B, C, w.D, z[:, 0],
                                   w.dt_proj_bias)[:, None]
    else:
        x, new_conv = causal_conv1d(x, w.conv_weight, w.conv_bias, conv_state)
        conv_state.copy_(new_conv)
        dt, B, C = F.linear(x, w.x_proj_weight).split([dt_rank, d_state, d_state], dim=-1)
        y, h = selective_scan(x, F.linear(dt, w.dt_proj_weight), A, B, C, w.D, z, w.dt_proj_bias,
                              initial_state=ssm_state)
        ssm_state.copy_(h)
    return F.linear(y.to(hidden.dtype), w.out_proj_weight, w.out_proj_bias)


def mamba2_mixer_forward(hidden: torch.Tensor, w: Mamba2Weights, conv_state: torch.Tensor,
                         ssm_state: torch.Tensor) -> torch.Tensor:
    """hidden [batch, seqlen, hidden]; conv_state [batch, conv_dim, w-1] and ssm_state [batch, heads, head_dim,
    d_state] hold the state before this call and are updated in place. One token takes the step path."""
    batch, seqlen, _ = hidden.shape
    heads = w.A_log.shape[0]
    d_inner = heads * w.head_dim
    group_dim = w.n_groups * w.d_state
    z, xBC, dt = F.linear(hidden, w.in_proj_weight, w.in_proj_bias).split(
        [d_inner, d_inner + 2 * group_dim, heads], dim=-1)
    A = -torch.exp(w.A_log.float())
    if seqlen == 1:
        xBC = causal_conv1d_update(xBC[:, 0], conv_state, w.conv_weight, w.conv_bias)[:, None]
    else:
        xBC, new_conv = causal_conv1d(xBC, w.conv_weight, w.conv_bias, conv_state)
        conv_state.copy_(new_conv)
    x, B, C = xBC.split([d_inner, group_dim, group_dim], dim=-1)
    x = x.unflatten(-1, (heads, w.head_dim))
    B = B.unflatten(-1, (w.n_groups, w.d_state))
    C = C.unflatten(-1, (w.n_groups, w.d_state))
    if seqlen == 1:
        y = ssd_state_update(ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], w.D, w.dt_bias,
                             dt_limit=w.dt_limit)[:, None]
    else:
        y, h = ssd_chunked(x, dt, A, B, C, w.D, w.dt_bias, dt_limit=w.dt_limit, initial_state=ssm_state,
                           chunk_size=w.chunk_size)
        ssm_state.copy_(h)
    y = gated_rms_norm(y.reshape(batch, seqlen, d_inner), z, w.norm_weight, w.norm_eps, d_inner // w.n_groups)
    return F.linear(y.to(hidden.dtype), w.out_proj_weight, w.out_proj_bias)
