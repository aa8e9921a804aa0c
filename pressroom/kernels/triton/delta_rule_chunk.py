"""The gated delta rule's chunked prefill over packed sequences, each continuing from (and leaving its final state in)
a slot of a state pool [num_slots, H_v, d_k, d_v]. Reference: pressroom.kernels.delta_rule.chunk_gated_delta_rule
(the recurrence, the chunked (WY/UT) form and the layouts are in that module's docstring); both gates, GDN's scalar
[T, H_v] and KDA's per-channel [T, H_v, d_k].

Three kernels. The first two do the work that does not depend on the state, in parallel over (chunk, value head):
  1. the gate's cumulative sum within each chunk, G [T, H_v, 1 or d_k] (fp32);
  2. the UT transform: T = (I + L)^-1 by forward substitution, then W_k = T (beta K exp G), W_v = T (beta V), and
     the decayed causal scores A_qk = (Q K^T decayed, i >= j), each stored per token.
The third walks each sequence's chunks in order, one program per (sequence, value head, block of d_v columns; the
columns of the state are independent), with that state tile in registers:
     U = W_v - W_k S,    O = (Q exp G) S + A_qk U,    S <- diag(exp G_last) S + (K exp(G_last - G))^T U.
Chunks are cut per sequence (a sequence's last chunk may be short); the chunk table is built on the device from an
upper bound on the chunk count, so nothing waits for the host. A negative slot is padding: zero outputs, no state
read or written. Math is fp32; dots of fp32 inputs are exact fp32 ("ieee"), of 16-bit inputs TF32.

Scratch: G, W_k, W_v and A_qk in fp32, (2 d_k + d_v + 64) floats per token and value head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pressroom.kernels.delta_rule import L2NORM_EPS

CHUNK_SIZE = 64
_SUB = tl.constexpr(16)  # KDA: rows of a diagonal block of the chunk's scores (see _per_channel_scores)
_BLOCK_V = 32  # state columns per program of the scan: a 128 x 32 fp32 state tile
_MAX_HEAD_DIM = 256


@triton.jit
def _load_qk(ptr, tokens, stride_t, cols, row_ok, col_ok, scale, eps, NORMALIZE: tl.constexpr):
    """A [C, BLOCK_K] tile of q or k rows in fp32, L2-normalized when asked, times scale; zeros outside."""
    x = tl.load(ptr + tokens[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    if NORMALIZE:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None]
    return x * scale


@triton.jit
def _gate_cumsum_kernel(g_ptr, G_ptr, chunk_start_ptr, chunk_end_ptr, stride_gt, stride_gh, stride_Gt, stride_Gh,
                        gate_width, CHUNK: tl.constexpr, BLOCK_G: tl.constexpr):
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
    if end > start:
        rows = tl.arange(0, CHUNK)
        chans = tl.arange(0, BLOCK_G)
        ok = (rows < end - start)[:, None] & (chans < gate_width)[None, :]
        tokens = start + rows
        g = tl.load(g_ptr + tokens[:, None] * stride_gt + head * stride_gh + chans[None, :], mask=ok, other=0.0)
        G = tl.cumsum(g.to(tl.float32), 0)
        tl.store(G_ptr + tokens[:, None] * stride_Gt + head * stride_Gh + chans[None, :], G, mask=ok)


@triton.jit
def _per_channel_scores(q, k, G, k_ptr, G_ptr, start, length, stride_kt, stride_Gt, d_k, eps,
                        NORMALIZE_QK: tl.constexpr, DOT_PRECISION: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """KDA's decayed scores of a chunk: (L / beta, strictly below the diagonal; A_qk, on and below it), where
    score_ij = sum_d a_i[d] k_j[d] exp(G_i[d] - G_j[d]). A per-channel decay has no exact matmul form over the whole
    chunk, so blocks of _SUB rows are taken apart. Below a row block's diagonal block, the block's first row n is a
    reference point: exp(G_i - G_j) = exp(G_i - G_n) exp(G_n - G_j), both factors <= 1 (i >= n > j), one matmul.
    Within the diagonal blocks, column by column, exactly (the 4 blocks at once: row i takes column j of its own)."""
    rows = tl.arange(0, CHUNK)
    cols = tl.arange(0, CHUNK)
    dk = tl.arange(0, BLOCK_K)
    dk_ok = dk < d_k
    row_ok = rows < length
    block_first = (rows // _SUB) * _SUB
    akk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    aqk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for first in tl.static_range(_SUB, CHUNK, _SUB):
        G_n = tl.load(G_ptr + (start + first) * stride_Gt + dk, mask=dk_ok & (first < length), other=0.0)
        in_block = ((block_first == first) & row_ok)[:, None] & dk_ok[None, :]
        earlier = ((rows < first) & (first < length))[:, None] & dk_ok[None, :]  # G_n is a real row's
        # masked before exp: outside its rows each exponent could be positive and overflow
        to_row = tl.exp(tl.where(in_block, G - G_n[None, :], -float("inf")))
        keys = tl.trans(k * tl.exp(tl.where(earlier, G_n[None, :] - G, -float("inf"))))
        akk += tl.dot(k * to_row, keys, input_precision=DOT_PRECISION)
        aqk += tl.dot(q * to_row, keys, input_precision=DOT_PRECISION)
    for offset in range(0, _SUB):
        j = block_first + offset  # the column row i takes, in its own diagonal block
        j_ok = j < length
        k_j = _load_qk(k_ptr, start + j, stride_kt, dk, j_ok, dk_ok, 1.0, eps, NORMALIZE_QK)
        G_j = tl.load(G_ptr + (start + j)[:, None] * stride_Gt + dk[None, :], mask=j_ok[:, None] & dk_ok[None, :],
                      other=0.0)
        later = ((rows >= j) & row_ok)[:, None] & dk_ok[None, :]
        decayed = tl.exp(tl.where(later, G - G_j, -float("inf"))) * k_j
        at_j = cols[None, :] == j[:, None]
        akk = tl.where(at_j & (rows > j)[:, None], tl.sum(k * decayed, 1)[:, None], akk)
        aqk = tl.where(at_j, tl.sum(q * decayed, 1)[:, None], aqk)
    return akk, aqk


@triton.jit
def _wy_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, G_ptr, wk_ptr, wv_ptr, aqk_ptr, chunk_start_ptr, chunk_end_ptr,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_bh,
               stride_Gt, stride_Gh, stride_wkt, stride_wkh, stride_wvt, stride_wvh, stride_at, stride_ah,
               group, d_k, d_v, scale, eps,
               NORMALIZE_QK: tl.constexpr, SCALAR_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr):
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
    if end > start:
        length = (end - start).to(tl.int32)
        rows = tl.arange(0, CHUNK)
        cols = tl.arange(0, CHUNK)
        dk = tl.arange(0, BLOCK_K)
        dv = tl.arange(0, BLOCK_DV)
        row_ok = rows < length
        dk_ok = dk < d_k
        tokens = start + rows
        key_head = head // group
        q = _load_qk(q_ptr + key_head * stride_qh, tokens, stride_qt, dk, row_ok, dk_ok, scale, eps, NORMALIZE_QK)
        k = _load_qk(k_ptr + key_head * stride_kh, tokens, stride_kt, dk, row_ok, dk_ok, 1.0, eps, NORMALIZE_QK)
        beta = tl.load(beta_ptr + tokens * stride_bt + head * stride_bh, mask=row_ok, other=0.0).to(tl.float32)
        below = (rows[:, None] > cols[None, :]) & row_ok[:, None]  # strictly lower: L's support
        causal = (rows[:, None] >= cols[None, :]) & row_ok[:, None]  # with the diagonal: A_qk's
        if SCALAR_GATE:
            G = tl.load(G_ptr + tokens * stride_Gt + head * stride_Gh, mask=row_ok, other=0.0)
            diff = G[:, None] - G[None, :]
            # masked before exp: above the diagonal the exponent is positive and could overflow
            akk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * tl.exp(tl.where(below, diff, -float("inf")))
            aqk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * tl.exp(tl.where(causal, diff, -float("inf")))
            k_gated = k * tl.exp(G)[:, None]
        else:
            tile_ok = row_ok[:, None] & dk_ok[None, :]
            G = tl.load(G_ptr + tokens[:, None] * stride_Gt + head * stride_Gh + dk[None, :], mask=tile_ok, other=0.0)
            akk, aqk = _per_channel_scores(q, k, G, k_ptr + key_head * stride_kh, G_ptr + head * stride_Gh, start,
                                           length, stride_kt, stride_Gt, d_k, eps, NORMALIZE_QK, DOT_PRECISION,
                                           CHUNK, BLOCK_K)
            k_gated = k * tl.exp(G)
        akk = akk * beta[:, None]
        # T = (I + L)^-1, row by row: T_i = e_i - sum_{j<i} L_ij T_j (rows past the chunk's end stay e_i)
        inverse = (rows[:, None] == cols[None, :]).to(tl.float32)
        for i in range(1, length):
            l_i = tl.sum(tl.where(rows[:, None] == i, akk, 0.0), 0)
            t_i = (cols == i).to(tl.float32) - tl.sum(l_i[:, None] * inverse, 0)
            inverse = tl.where(rows[:, None] == i, t_i[None, :], inverse)
        wk = tl.dot(inverse, k_gated * beta[:, None], input_precision=DOT_PRECISION)
        v_ok = row_ok[:, None] & (dv < d_v)[None, :]
        v = tl.load(v_ptr + tokens[:, None] * stride_vt + head * stride_vh + dv[None, :], mask=v_ok, other=0.0)
        wv = tl.dot(inverse, v.to(tl.float32) * beta[:, None], input_precision=DOT_PRECISION)
        tl.store(wk_ptr + tokens[:, None] * stride_wkt + head * stride_wkh + dk[None, :], wk,
                 mask=row_ok[:, None] & dk_ok[None, :])
        tl.store(wv_ptr + tokens[:, None] * stride_wvt + head * stride_wvh + dv[None, :], wv, mask=v_ok)
        tl.store(aqk_ptr + tokens[:, None] * stride_at + head * stride_ah + cols[None, :], aqk, mask=row_ok[:, None])


@triton.jit
def _scan_kernel(q_ptr, k_ptr, G_ptr, wk_ptr, wv_ptr, aqk_ptr, pool_ptr, slot_ptr, cu_ptr, out_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_Gt, stride_Gh, stride_wkt, stride_wkh,
                 stride_wvt, stride_wvh, stride_at, stride_ah, stride_ps, stride_ph, stride_pk, stride_ot, stride_oh,
                 group, d_k, d_v, scale, eps,
                 NORMALIZE_QK: tl.constexpr, SCALAR_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if slot >= 0:
        bos = tl.load(cu_ptr + seq).to(tl.int64)
        eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
        rows = tl.arange(0, CHUNK)
        cols = tl.arange(0, CHUNK)
        dk = tl.arange(0, BLOCK_K)
        dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        dk_ok = dk < d_k
        dv_ok = dv < d_v
        key_head = head // group
        tile = slot * stride_ps + head * stride_ph + dk[:, None] * stride_pk + dv[None, :]
        tile_ok = dk_ok[:, None] & dv_ok[None, :]
        state = tl.load(pool_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
        for c in range(0, tl.cdiv(eos - bos, CHUNK).to(tl.int32)):  # an int32 loop; offsets stay int64
            start = bos + c * CHUNK
            length = tl.minimum(eos - start, CHUNK).to(tl.int32)
            row_ok = rows < length
            tokens = start + rows
            q = _load_qk(q_ptr + key_head * stride_qh, tokens, stride_qt, dk, row_ok, dk_ok, scale, eps,
                         NORMALIZE_QK)
            k = _load_qk(k_ptr + key_head * stride_kh, tokens, stride_kt, dk, row_ok, dk_ok, 1.0, eps, NORMALIZE_QK)
            kt_ok = row_ok[:, None] & dk_ok[None, :]
            wk = tl.load(wk_ptr + tokens[:, None] * stride_wkt + head * stride_wkh + dk[None, :], mask=kt_ok,
                         other=0.0)
            v_ok = row_ok[:, None] & dv_ok[None, :]
            wv = tl.load(wv_ptr + tokens[:, None] * stride_wvt + head * stride_wvh + dv[None, :], mask=v_ok,
                         other=0.0)
            aqk = tl.load(aqk_ptr + tokens[:, None] * stride_at + head * stride_ah + cols[None, :],
                          mask=row_ok[:, None], other=0.0)
            last = start + length - 1
            if SCALAR_GATE:
                G = tl.load(G_ptr + tokens * stride_Gt + head * stride_Gh, mask=row_ok, other=0.0)
                G_last = tl.load(G_ptr + last * stride_Gt + head * stride_Gh)
                q_gated = q * tl.exp(G)[:, None]
                # rows past the end: their k is zero, and -inf keeps the (positive) exponent from overflowing
                k_to_end = k * tl.exp(tl.where(row_ok, G_last - G, -float("inf")))[:, None]
                state_decay = tl.exp(G_last)
            else:
                G = tl.load(G_ptr + tokens[:, None] * stride_Gt + head * stride_Gh + dk[None, :], mask=kt_ok,
                            other=0.0)
                G_last = tl.load(G_ptr + last * stride_Gt + head * stride_Gh + dk, mask=dk_ok, other=0.0)
                q_gated = q * tl.exp(G)
                k_to_end = k * tl.exp(tl.where(kt_ok, G_last[None, :] - G, -float("inf")))
                state_decay = tl.exp(G_last)[:, None]
            updates = wv - tl.dot(wk, state, input_precision=DOT_PRECISION)
            o = tl.dot(q_gated, state, input_precision=DOT_PRECISION)
            o += tl.dot(aqk, updates, input_precision=DOT_PRECISION)
            tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=v_ok)
            state = state * state_decay + tl.dot(tl.trans(k_to_end), updates, input_precision=DOT_PRECISION)
        tl.store(pool_ptr + tile, state.to(pool_ptr.dtype.element_ty), mask=tile_ok)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> None:
    tokens, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    num_seqs = cu_seqlens.shape[0] - 1
    if (q.shape != k.shape or v.shape[0] != tokens or h_v % h_k or g.shape not in ((tokens, h_v), (tokens, h_v, d_k))
            or beta.shape != (tokens, h_v) or states.shape[1:] != (h_v, d_k, d_v) or slots.shape != (num_seqs,)
            or d_k > _MAX_HEAD_DIM or d_v > _MAX_HEAD_DIM):
        raise ValueError(f"chunk_delta_rule_varlen: q, k [T, H_k, d_k <= {_MAX_HEAD_DIM}], v [T, H_v, d_v], g [T, H_v] "
                         f"or [T, H_v, d_k], beta [T, H_v], states [slots, H_v, d_k, d_v], slots [N] for cu_seqlens "
                         f"[N + 1]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}, states {tuple(states.shape)}, slots "
                         f"{tuple(slots.shape)}, cu_seqlens {tuple(cu_seqlens.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, states)):
        raise ValueError("chunk_delta_rule_varlen: q, k, v, g and states need a unit stride in their last dim")


def chunk_table(cu_seqlens: torch.Tensor, num_tokens: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) token offsets of every chunk of every sequence, chunks cut at each sequence's start, padded with
    empty (start == end) chunks to a length known without reading cu_seqlens on the host: num_tokens // chunk + N."""
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    ends_of_seqs = counts.cumsum(0)  # one past each sequence's last chunk index
    ids = torch.arange(num_tokens // chunk + num_seqs, device=cu.device)
    seq = torch.searchsorted(ends_of_seqs, ids, right=True).clamp(max=max(num_seqs - 1, 0))
    start = cu[seq] + (ids - (ends_of_seqs[seq] - counts[seq])) * chunk
    end = torch.minimum(start + chunk, cu[seq + 1])
    real = ids < ends_of_seqs[-1] if num_seqs else torch.zeros_like(ids, dtype=torch.bool)
    return start, torch.where(real, end, start)


def chunk_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            cu_seqlens: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                            normalize_qk: bool = True, scale: float | None = None) -> torch.Tensor:
    """Packed prefill: q, k [T, H_k, d_k], v [T, H_v, d_v], g [T, H_v] (GDN) or [T, H_v, d_k] (KDA), beta [T, H_v];
    sequence i (tokens cu_seqlens[i]:cu_seqlens[i+1]) starts from states[slots[i]] and leaves its final state there,
    in the pool's dtype (a negative slot is padding: zero outputs, state untouched). Returns o [T, H_v, d_v] in v's
    dtype."""
    _check(q, k, v, g, beta, cu_seqlens, states, slots)
    tokens, h_k, d_k = k.shape
    h_v, d_v = v.shape[-2:]
    num_seqs = cu_seqlens.shape[0] - 1
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if tokens == 0 or num_seqs == 0:
        return out
    scalar = g.dim() == 2
    gate_width = 1 if scalar else d_k
    scale = scale if scale is not None else d_k ** -0.5
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    block_k, block_dv = max(16, triton.next_power_of_2(d_k)), max(16, triton.next_power_of_2(d_v))
    starts, ends = chunk_table(cu_seqlens, tokens, CHUNK_SIZE)
    f32 = dict(dtype=torch.float32, device=v.device)
    G = torch.empty(tokens, h_v, gate_width, **f32)
    wk, wv, aqk = (torch.empty(tokens, h_v, width, **f32) for width in (d_k, d_v, CHUNK_SIZE))
    chunk_grid = (starts.shape[0], h_v)
    _gate_cumsum_kernel[chunk_grid](g, G, starts, ends, g.stride(0), g.stride(1), G.stride(0), G.stride(1),
                                    gate_width, CHUNK=CHUNK_SIZE, BLOCK_G=max(2, triton.next_power_of_2(gate_width)))
    common = dict(NORMALIZE_QK=normalize_qk, SCALAR_GATE=scalar, DOT_PRECISION=precision, CHUNK=CHUNK_SIZE,
                  BLOCK_K=block_k)
    _wy_kernel[chunk_grid](q, k, v, beta, G, wk, wv, aqk, starts, ends,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           beta.stride(0), beta.stride(1), G.stride(0), G.stride(1), wk.stride(0), wk.stride(1),
                           wv.stride(0), wv.stride(1), aqk.stride(0), aqk.stride(1),
                           h_v // h_k, d_k, d_v, scale, L2NORM_EPS, **common, BLOCK_DV=block_dv,
                           num_warps=8 if block_k >= 128 else 4)  # several [64, d_k] fp32 tiles live at once
    block_v = min(_BLOCK_V, block_dv)
    _scan_kernel[(num_seqs, h_v, triton.cdiv(d_v, block_v))](
        q, k, G, wk, wv, aqk, states, slots, cu_seqlens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), G.stride(0), G.stride(1), wk.stride(0), wk.stride(1),
        wv.stride(0), wv.stride(1), aqk.stride(0), aqk.stride(1), states.stride(0), states.stride(1),
        states.stride(2), out.stride(0), out.stride(1),
        h_v // h_k, d_k, d_v, scale, L2NORM_EPS, **common, BLOCK_V=block_v, num_warps=4,
        num_stages=scan_pipeline_stages(block_k, v.dtype == torch.float32, scalar))
    return out


def scan_pipeline_stages(block_k: int, fp32: bool, scalar_gate: bool) -> int:
    """How many chunks' tiles the scan loads ahead. Each stage buffers a chunk's q, k, W_k, W_v, A_qk (and KDA's
    per-channel G) in shared memory: two stages fit an H100's 227 KiB at d_k <= 128 except fp32 KDA (233 KiB);
    d_k 256 fits only one (measured with tests/kernels/test_triton_smem.py)."""
    return 2 if block_k <= 128 and not (fp32 and not scalar_gate) else 1
