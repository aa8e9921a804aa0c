"""Fused mixture-of-experts over FP8 experts with DeepSeek's 128 x 128 block scales (kernels/fp8_moe.py's form):
fused_moe.py's two grouped GEMMs over the (token, expert) pairs sorted by expert (its alignment, pair epilogue and
top-k sum, imported), each tile reading FP8 weights and their blocks' scales.

With `quantize_activations` (the default, DeepSeek's recipe) the activations are quantized to FP8 per token and
128-input group by one launch before each GEMM (the experts' input, then the intermediate SiLU(gate) * up, stored in
x's dtype first; `pow2_scales`: each group's scale rounded up to a power of two, for checkpoints with scale_fmt
ue8m0), and each tile is an FP8 x FP8 tl.dot (FP8 tensor cores: compute capability 8.9 and later); a tile
spans at most one group (BLOCK_K divides 128), so its fp32 product takes one activation scale per row and one weight
scale per output column. Without, the weights are widened in registers and multiplied with the activations as they
are (weight-only, as kernels/triton/quant_gemv.py does for linear layers).

Launches come from a sweep per shape and GPU (`sweep`, written to moe_configs/ beside the bf16 tables, names ending
in `_fp8_block128_<gpu>.json`), looked up by the nearest token count; without one, `default_launch`'s rows per
block with 128 inputs a tile.

Small steps (batch-1 decode) take fused_moe.py's token-major GEMVs over the FP8 experts instead (`MoeLaunch.gemv`):
each pair's token quantized per 128-input group in registers (the same fp32 operations as `quantize_groups`), its
gate/up and SwiGLU in one launch, then each token's k down projections (its pairs' intermediate rows quantized
likewise), weighted and summed, in a second: two launches where the grouped path takes six (two quantizations, the
alignment, two GEMMs, the top-k sum).
"""
from __future__ import annotations

import functools
import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton
import triton.language as tl

from pressroom.kernels import fp8
from pressroom.kernels.fp8_moe import BLOCK, Fp8Experts, quantize
from pressroom.kernels.triton.fused_moe import (
    DOWN_TILE_WEIGHTS,
    GEMV_MAX_TOKENS,
    MoeLaunch,
    _block_pairs,
    _gated,
    _store_pairs,
    align_by_expert,
    default_launch,
    load_sweep,
    nearest_launch,
    sum_top_k,
    sweep_path,
)

SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes a launch's pipelined tiles may take (H100 and H200: 227 KiB per block)
GROUPS_PER_PROGRAM = 8  # activation groups one quantization program takes
GEMV_SWEEP_TOKENS = 16  # the sweep times the GEMVs up to here


def fp8_sweep_path(experts: int, inter: int, hidden: int, top_k: int, gpu: str) -> Path:
    return sweep_path(experts, inter, hidden, top_k, "fp8_block128", gpu)


@functools.cache
def _launch_table(experts: int, inter: int, hidden: int, top_k: int, device: int) -> dict[int, MoeLaunch]:
    return load_sweep(fp8_sweep_path(experts, inter, hidden, top_k, torch.cuda.get_device_name(device)))


def fp8_default_launch(tokens: int, top_k: int, experts: int) -> MoeLaunch:
    """default_launch's rows per block, a whole 128-input group per tile."""
    launch = default_launch(tokens, top_k, experts)
    return MoeLaunch(launch.block_m, launch.block_n, BLOCK, launch.num_warps, launch.num_stages)


def fp8_gemv_launch() -> MoeLaunch:
    """The GEMVs without a sweep: 16 columns a program (the up pass's activation group, widened and scaled, serves
    twice the rows of 8: 5.75 sm_90 instructions a weight against 7.5, benchmarks/sass_loops.py; the down pass takes
    8 at top-8), two tiles in flight, one 128-input group a tile."""
    return MoeLaunch(1, 16, BLOCK, 4, 2, gemv=True)


def choose_launch(tokens: int, w13: Fp8Experts, top_k: int) -> MoeLaunch:
    experts, double_inter, hidden = w13.shape
    table = {}
    if w13.weight.device.type == "cuda":  # Triton's interpreter: correctness only, the defaults
        table = _launch_table(experts, double_inter // 2, hidden, top_k, w13.weight.device.index or 0)
    if table:
        return nearest_launch(table, tokens)
    return fp8_gemv_launch() if tokens <= GEMV_MAX_TOKENS else fp8_default_launch(tokens, top_k, experts)


@triton.jit
def _on_fp8_grid(x):
    """fp32 x (|x| <= 448) rounded to e4m3's nearest value, ties to even, still fp32, so the cast that follows is
    exact. Triton 3.6's interpreter casts fp32 to fp8 rounding half up without carrying into the exponent (7.9 became
    4.0); on the GPU this costs a few integer ops of a memory-bound launch."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (x + 24576.0) - 24576.0  # multiples of 2^-9: the ulp of fp32 in [2^14, 2^15)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _power_of_two_above(x):
    """Positive normal fp32 x rounded up to a power of two (itself where it is one): exact, by its bits."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_s, MIN_AMAX: tl.constexpr,
                            FP8_LIMIT: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, POW2: tl.constexpr):
    """One row's GROUPS groups of GROUP inputs: kernels/fp8.py's `quantize` (the same fp32 operations; POW2: its
    power-of-two scales)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = col < cols
    x = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX) / FP8_LIMIT
    if POW2:
        scale = _power_of_two_above(scale)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_LIMIT, FP8_LIMIT)  # rounded division, as torch's
    tl.store(q_ptr + row * stride_q + col, _on_fp8_grid(q).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + group, scale, mask=group * GROUP < cols)


def quantize_groups(x: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (FP8 [rows, cols], fp32 scales [rows, ceil(cols / 128)]): fp8.quantize(x, 128, pow2_scales),
    one launch."""
    rows, cols = x.shape
    groups = triton.cdiv(cols, BLOCK)
    q = torch.empty(rows, cols, dtype=fp8.FP8, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    per_program = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
    _quantize_groups_kernel[(rows, triton.cdiv(groups, per_program))](
        x, q, scale, cols, x.stride(0), q.stride(0), scale.stride(0), MIN_AMAX=1e-12, FP8_LIMIT=fp8.FP8_MAX,
        GROUP=BLOCK, GROUPS=per_program, POW2=pow2_scales, num_warps=4)
    return q, scale


@triton.jit
def _fp8_tile(a, a_scale, w_cols, ws_cols, ks, k_ok, k0, A_FP8: tl.constexpr, PRECISION: tl.constexpr,
              GROUP: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of activations times the weight columns' tile (w_cols: [1, BLOCK_N] row pointers,
    inputs ks), scaled: fp32 [BLOCK_M, BLOCK_N]. The tile lies in one group of inputs, the one k0 starts."""
    w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None], other=0.0)
    w_scale = tl.load(ws_cols + k0 // GROUP)
    if A_FP8:
        return tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
    return tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * w_scale[None, :]


@triton.jit
def _moe_fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, slots_ptr, block_expert_ptr, weights_ptr,
                         n_out, k_in, num_pairs, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
                         stride_c, top_k, up_scale_rows, limit, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr,
                         MUL_WEIGHTS: tl.constexpr, A_FP8: tl.constexpr, LIMITED: tl.constexpr,
                         PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """fused_moe.py's _moe_gemm_kernel over FP8 weights [E, N, K] with block scales [E, ceil(N / GROUP) (per half
    where GATED: up's from block row up_scale_rows), ceil(K / GROUP)]; A_FP8: FP8 activations with per-group scales
    [rows, ceil(K / GROUP)]. LIMITED: DeepSeek-V4's clamp of gate and up at `limit` before SwiGLU."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the used ones (a Triton helper cannot end its caller: the exit stays here)
        return
    slot, valid, a_row, cols, col_ok = _block_pairs(pid_m, pid_n, slots_ptr, num_pairs, top_k, n_out, A_BY_TOKEN,
                                                    BLOCK_M, BLOCK_N)
    e = expert.to(tl.int64)
    n = tl.where(col_ok, cols, 0)
    a_rows = a_ptr + a_row.to(tl.int64)[:, None] * stride_a
    as_rows = as_ptr + a_row.to(tl.int64) * stride_as
    w_cols = w_ptr + e * stride_we + n.to(tl.int64)[None, :] * stride_wn
    ws_cols = ws_ptr + e * stride_wse + (n // GROUP) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if A_FP8:
            a_scale = tl.load(as_rows + k0 // GROUP, mask=valid, other=0.0)
        acc += _fp8_tile(a, a_scale, w_cols, ws_cols, ks, k_ok, k0, A_FP8, PRECISION, GROUP)
        if GATED:  # up's rows lie n_out rows below gate's, its blocks' scales up_scale_rows block rows below
            acc_up += _fp8_tile(a, a_scale, w_cols + n_out * stride_wn, ws_cols + up_scale_rows * stride_wsn, ks,
                                k_ok, k0, A_FP8, PRECISION, GROUP)
    if LIMITED:
        acc = tl.minimum(acc, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    _store_pairs(acc, acc_up, c_ptr, weights_ptr, weights_ptr, expert, slot, valid, cols, col_ok, n_out, stride_c,
                 0, 1.0, 0.0, GATED, MUL_WEIGHTS, False, 0)  # ACTIVATION 0: SwiGLU (V4's clamp applied above)


@triton.jit
def _fp8_groups(a_rows, ok, k0, k_in, A_FP8: tl.constexpr, POW2: tl.constexpr, MIN_AMAX: tl.constexpr,
                FP8_LIMIT: tl.constexpr, GROUP: tl.constexpr):
    """Activation rows' (a_rows: each row's first input; rows not `ok` read zeros) group of GROUP inputs from k0, in
    fp32 [R, GROUP], and each row's scale for it [R]: 1, or where A_FP8 the group quantized as quantize_groups does
    (values on the FP8 grid, their scale returned)."""
    ks = k0 + tl.arange(0, GROUP)
    a = tl.load(a_rows[:, None] + ks[None, :], mask=ok[:, None] & (ks < k_in)[None, :], other=0.0).to(tl.float32)
    a_scale = tl.full(ok.shape, 1.0, tl.float32)
    if A_FP8:
        a_scale = tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX) / FP8_LIMIT
        if POW2:
            a_scale = _power_of_two_above(a_scale)
        a = _on_fp8_grid(tl.clamp(tl.math.div_rn(a, a_scale[:, None]), -FP8_LIMIT, FP8_LIMIT))
    return a, a_scale


@triton.jit
def _moe_fp8_up_gemv_kernel(x_ptr, w_ptr, ws_ptr, mid_ptr, ids_ptr, n_out, k_in, num_experts, stride_x, stride_we,
                            stride_wn, stride_wse, stride_wsn, stride_mid, top_k, up_scale_rows, limit,
                            A_FP8: tl.constexpr, POW2: tl.constexpr, LIMITED: tl.constexpr, MIN_AMAX: tl.constexpr,
                            FP8_LIMIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                            STAGES: tl.constexpr):
    """One (token, expert) pair's gate and up rows over its token (FP8 weights, block scales), through SwiGLU (V4's
    clamp first where LIMITED), out to mid's pair row. As fused_moe.py's bf16 GEMV: gate's and up's tiles load in
    one iteration, products add up elementwise (the group's scales folded into the activation: BLOCK_N divides
    GROUP, so a tile's rows share one block row of scales) and are summed across K once. Rows past the matrix read
    row 0 and are masked when stored. A pair of another rank's expert (-1) is skipped."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        return
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    e = expert.to(tl.int64)
    w_rows = w_ptr + e * stride_we + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_wn
    ws_gate = ws_ptr + e * stride_wse + (first // GROUP) * stride_wsn
    ws_up = ws_gate + up_scale_rows * stride_wsn
    one_row = tl.zeros((1,), dtype=tl.int64)  # the token's row as _fp8_groups's rows
    a_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x + one_row
    gate = tl.zeros((BLOCK_N, GROUP), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, GROUP), dtype=tl.float32)
    for k0 in tl.range(0, k_in, GROUP, num_stages=STAGES):
        a, a_scale = _fp8_groups(a_row, one_row == 0, k0, k_in, A_FP8, POW2, MIN_AMAX, FP8_LIMIT, GROUP)
        ks = k0 + tl.arange(0, GROUP)
        k_ok = (ks < k_in)[None, :]
        w_gate = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
        w_up = tl.load(w_rows + n_out * stride_wn + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
        group = k0 // GROUP
        gate += w_gate * (a * (a_scale * tl.load(ws_gate + group))[:, None])
        up += w_up * (a * (a_scale * tl.load(ws_up + group))[:, None])
    gate, up = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    if LIMITED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    mid = _gated(gate, up, 1.0, 0.0, 0)
    tl.store(mid_ptr + pair.to(tl.int64) * stride_mid + cols, mid.to(mid_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _moe_fp8_down_sum_gemv_kernel(mid_ptr, w_ptr, ws_ptr, out_ptr, ids_ptr, weights_ptr, n_out, k_in, num_experts,
                                  stride_mid, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                                  TOP_K: tl.constexpr, PAIRS: tl.constexpr, A_FP8: tl.constexpr, POW2: tl.constexpr,
                                  MIN_AMAX: tl.constexpr, FP8_LIMIT: tl.constexpr, GROUP: tl.constexpr,
                                  BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """One token's output: the sum over its TOP_K pairs of the pair's weight times its expert's FP8 down rows over
    the pair's mid row, in fp32, rounded once. As fused_moe.py's bf16 GEMV: all TOP_K experts' tiles load in one
    iteration (PAIRS: TOP_K rounded up to a power of two), each pair's group scales folded into its activations.
    Pairs of another rank's experts (-1) add nothing."""
    token = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    j = tl.arange(0, PAIRS)
    pair = token.to(tl.int64) * TOP_K + j
    expert = tl.load(ids_ptr + pair, mask=j < TOP_K, other=-1)
    here = (expert >= 0) & (expert < num_experts)
    e = tl.where(here, expert, 0).to(tl.int64)
    w_rows = w_ptr + e[:, None] * stride_we + tl.where(col_ok, cols, 0).to(tl.int64)[None, :] * stride_wn
    ws_rows = ws_ptr + e * stride_wse + (first // GROUP) * stride_wsn  # [PAIRS]: one block row of scales each
    mid_rows = mid_ptr + pair * stride_mid
    prods = tl.zeros((PAIRS, BLOCK_N, GROUP), dtype=tl.float32)
    for k0 in tl.range(0, k_in, GROUP, num_stages=STAGES):
        a, a_scale = _fp8_groups(mid_rows, here, k0, k_in, A_FP8, POW2, MIN_AMAX, FP8_LIMIT, GROUP)
        scale = a_scale * tl.load(ws_rows + k0 // GROUP, mask=here, other=0.0)
        ks = k0 + tl.arange(0, GROUP)
        k_ok = here[:, None] & (ks < k_in)[None, :]
        w = tl.load(w_rows[:, :, None] + ks[None, None, :], mask=k_ok[:, None, :], other=0.0).to(tl.float32)
        prods += w * (a * scale[:, None])[:, None, :]
    acc = tl.sum(prods, axis=2)
    weight = tl.load(weights_ptr + pair, mask=here, other=0.0)
    total = tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def _gemv_moe_fp8(x: torch.Tensor, w13: Fp8Experts, w2: Fp8Experts, flat_weights: torch.Tensor, ids: torch.Tensor,
                  cfg: MoeLaunch, quantize_activations: bool, swiglu_limit: float | None, pow2_scales: bool
                  ) -> torch.Tensor:
    """fused_moe_fp8's token-major path (two launches). The down pass takes fewer columns a program where the top-k
    experts' tiles would pass DOWN_TILE_WEIGHTS (a whole group a tile)."""
    tokens, hidden = x.shape
    experts, double_inter, _ = w13.shape
    inter, k = double_inter // 2, ids.shape[1]
    flat_ids = ids.reshape(-1).to(torch.int32)
    mid = torch.empty(tokens * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    common = dict(A_FP8=quantize_activations, POW2=pow2_scales, MIN_AMAX=1e-12, FP8_LIMIT=fp8.FP8_MAX, GROUP=BLOCK,
                  STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    _moe_fp8_up_gemv_kernel[(tokens * k, triton.cdiv(inter, cfg.block_n))](
        x, w13.weight, w13.scale, mid, flat_ids, inter, hidden, experts, x.stride(0), w13.weight.stride(0),
        w13.weight.stride(1), w13.scale.stride(0), w13.scale.stride(1), mid.stride(0), k, w13.scale.shape[1] // 2,
        float(swiglu_limit or 0.0), LIMITED=swiglu_limit is not None, BLOCK_N=cfg.block_n, **common)
    pairs = triton.next_power_of_2(k)
    down_n = max(1, min(cfg.block_n, DOWN_TILE_WEIGHTS // (pairs * BLOCK)))
    _moe_fp8_down_sum_gemv_kernel[(tokens, triton.cdiv(hidden, down_n))](
        mid, w2.weight, w2.scale, out, flat_ids, flat_weights, hidden, inter, experts, mid.stride(0),
        w2.weight.stride(0), w2.weight.stride(1), w2.scale.stride(0), w2.scale.stride(1), out.stride(0), TOP_K=k,
        PAIRS=pairs, BLOCK_N=down_n, **common)
    return out


def check_experts(w13: Fp8Experts, w2: Fp8Experts, hidden: int) -> None:
    experts, double_inter, _ = w13.shape
    if w13.halves != 2 or w2.halves != 1:
        raise ValueError("FP8 experts: w13 must hold gate and up on grids of their own (halves=2), w2 one grid.")
    if w13.shape[2] != hidden or w2.shape != (experts, hidden, double_inter // 2):
        raise ValueError(f"FP8 experts of shapes {w13.shape} and {w2.shape} do not fit {hidden} hidden features.")
    if any(t.stride(2) != 1 for w in (w13, w2) for t in (w.weight, w.scale)):
        raise ValueError("FP8 experts and their scales must be contiguous along their inputs (the last dimension).")


def fused_moe_fp8(x: torch.Tensor, w13: Fp8Experts, w2: Fp8Experts, weights: torch.Tensor, ids: torch.Tensor,
                  launch: MoeLaunch | None = None, all_local: bool = False, quantize_activations: bool = True,
                  swiglu_limit: float | None = None, pow2_scales: bool = False) -> torch.Tensor:
    """x [T, H] (bf16, fp16 or fp32); w13 [E, 2I, H] (halves=2) and w2 [E, H, I] as
    Fp8Experts; weights (fp32) and ids [T, k] local to the experts (-1: another rank's; `all_local`: there are none).
    Returns [T, H] in x's dtype, what kernels/fp8_moe.py's `reference` computes. `swiglu_limit`: DeepSeek-V4's
    clamped SwiGLU; `pow2_scales`: activations scaled by powers of two (checkpoints with scale_fmt ue8m0)."""
    tokens, hidden = x.shape
    check_experts(w13, w2, hidden)
    experts, double_inter, _ = w13.shape
    inter, k = double_inter // 2, ids.shape[1]
    pairs = tokens * k
    cfg = launch or choose_launch(tokens, w13, k)
    if BLOCK % cfg.block_k or cfg.block_k < 32 or cfg.gemv and (cfg.block_k != BLOCK or BLOCK % cfg.block_n):
        raise ValueError(f"FP8 tiles of {cfg.block_k} inputs: use 32, 64 or 128 (a tile lies in one 128-input group; "
                         "the GEMVs take whole groups, 128, and columns that divide one: a block row of scales).")
    if tokens == 0:
        return torch.empty_like(x)
    if cfg.gemv:
        return _gemv_moe_fp8(x.contiguous(), w13, w2, weights.reshape(-1).float().contiguous(), ids, cfg,
                             quantize_activations, swiglu_limit, pow2_scales)
    slots, block_expert = align_by_expert(ids, experts, cfg.block_m)
    mid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # pairs no block holds are never read
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    common = dict(num_pairs=pairs, top_k=k, limit=float(swiglu_limit or 0.0), A_FP8=quantize_activations,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP=BLOCK, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    x = x.contiguous()
    passes = ((x, w13, mid, inter, hidden, True), (mid, w2, out, hidden, inter, False))
    for a, w, c, n_out, k_in, by_token in passes:
        a, a_scale = quantize_groups(a, pow2_scales) if quantize_activations else (a, flat_weights)
        grid = (block_expert.numel(), triton.cdiv(n_out, cfg.block_n))
        _moe_fp8_gemm_kernel[grid](
            a, a_scale, w.weight, w.scale, c, slots, block_expert, flat_weights, n_out=n_out, k_in=k_in,
            stride_a=a.stride(0), stride_as=a_scale.stride(0), stride_we=w.weight.stride(0),
            stride_wn=w.weight.stride(1), stride_wse=w.scale.stride(0), stride_wsn=w.scale.stride(1),
            stride_c=c.stride(0), up_scale_rows=w.scale.shape[1] // 2, A_BY_TOKEN=by_token, GATED=by_token,
            MUL_WEIGHTS=not by_token, LIMITED=by_token and swiglu_limit is not None, **common)
    return sum_top_k(out.view(tokens, k, hidden))


def sweep_candidates(tokens: int, top_k: int, experts: int) -> list[MoeLaunch]:
    """Up to GEMV_SWEEP_TOKENS tokens the GEMVs' column blocks and warps (a whole group a tile); then rows per block no
    larger than twice the pairs an expert gets on average (16 always); the pipelined FP8 tiles (activations, gate's
    and up's weights) within the shared-memory budget."""
    gemvs = [MoeLaunch(1, n, BLOCK, w, s, gemv=True)
             for n, w, s in itertools.product((4, 8, 16, 32), (2, 4, 8), (1, 2))]
    per_expert = tokens * top_k / experts
    space = {16: ((32, 64, 128), (64, 128), (4, 8), (3, 4, 5)),
             32: ((64, 128), (64, 128), (4, 8), (3, 4)),
             64: ((64, 128, 256), (64, 128), (4, 8), (3, 4)),
             128: ((64, 128, 256), (128,), (4, 8), (3, 4))}
    out = gemvs if tokens <= GEMV_SWEEP_TOKENS else []
    for block_m, (ns, ks, warps, stages) in space.items():
        if block_m > 16 and block_m > 2 * per_expert:
            continue
        for n, k, w, s in itertools.product(ns, ks, warps, stages):
            if s * (block_m * k + 2 * k * n) <= SHARED_MEMORY_BUDGET:
                out.append(MoeLaunch(block_m, n, k, w, s))
    return out


def _random_experts(experts: int, rows: int, cols: int, halves: int) -> Fp8Experts:
    """Random FP8 experts on the GPU, quantized a few experts at a time (a whole fp32 stack would not fit)."""
    parts = [quantize(torch.randn(min(8, experts - e), rows, cols, device="cuda") * 0.02, halves)
             for e in range(0, experts, 8)]
    return Fp8Experts(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), halves)


def _time_launch(args: tuple, launch: MoeLaunch) -> float | None:
    """Microseconds per call replayed from a CUDA graph; None where the launch does not run on this GPU."""
    from triton.testing import do_bench_cudagraph
    try:
        fused_moe_fp8(*args, launch=launch, all_local=True)  # compile outside the graph
        return do_bench_cudagraph(lambda: fused_moe_fp8(*args, launch=launch, all_local=True), rep=20) * 1e3
    except (triton.errors.TritonError, RuntimeError) as e:  # out of shared memory, or no compile for this launch
        print(f"  skip {launch}: {type(e).__name__}", flush=True)
        return None


def _routed(tokens: int, experts: int, top_k: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """bf16 activations and uniform random routing: (x, weights, ids)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    top = torch.randn(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1)
    return x, torch.softmax(top.values, dim=-1), top.indices


def _table_so_far(path: Path, shape: dict[str, int]) -> dict[str, dict]:
    """The entries an earlier run wrote to `path` for this shape (a long sweep may run in parts), else empty ones."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    if earlier.get("shape") != shape:
        return {"best": {}, "best_us": {}, "default_us": {}}
    return {key: earlier[key] for key in ("best", "best_us", "default_us")}


def sweep(experts: int, inter: int, hidden: int, top_k: int, token_counts: tuple[int, ...] = SWEEP_TOKENS,
          path: Path | None = None) -> Path:
    """Time every candidate launch of fused_moe_fp8 (both quantizations, alignment, both GEMMs, the top-k sum, from
    a CUDA graph, uniform random routing, bf16 activations) for this expert shape on this GPU, and write the fastest
    per token count where choose_launch reads it (or to `path`), saving after each count and keeping the counts an
    earlier run of the same shape wrote (a long sweep can run in parts). DeepSeek-V3 on one GPU:
    sweep(256, 2048, 7168, 8)."""
    gpu = torch.cuda.get_device_name()
    path = path or fp8_sweep_path(experts, inter, hidden, top_k, gpu)
    shape = {"experts": experts, "inter": inter, "hidden": hidden, "top_k": top_k}
    table = _table_so_far(path, shape)
    w13, w2 = _random_experts(experts, 2 * inter, hidden, 2), _random_experts(experts, hidden, inter, 1)
    header = {"shape": shape, "dtype": "fp8_e4m3 weights, 128x128 block scales; bf16 activations quantized per 1x128 "
                                       "group", "gpu": gpu, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "timing": "do_bench_cudagraph(rep=20 ms) of fused_moe_fp8: activation quantization + alignment + both "
                        "GEMMs + top-k sum, or the two GEMVs (gemv: true); uniform random routing"}
    for tokens in token_counts:
        x, weights, ids = _routed(tokens, experts, top_k, hidden)
        args = (x, w13, w2, weights, ids)
        start = time.perf_counter()
        timed = {c: _time_launch(args, c) for c in sweep_candidates(tokens, top_k, experts)}
        timed = {c: t for c, t in timed.items() if t is not None}
        winner = min(timed, key=timed.get)
        fallback = fp8_gemv_launch() if tokens <= GEMV_MAX_TOKENS else fp8_default_launch(tokens, top_k, experts)
        base = timed.get(fallback) or _time_launch(args, fallback)
        table["best"][str(tokens)], table["best_us"][str(tokens)] = asdict(winner), round(timed[winner], 2)
        table["default_us"][str(tokens)] = None if base is None else round(base, 2)
        print(f"tokens {tokens:>6}: best {timed[winner]:9.1f} us {winner}; default {base} us; "
              f"{len(timed)} launches in {time.perf_counter() - start:.0f} s", flush=True)
        path.write_text(json.dumps({**header, **table}, indent=1) + "\n")
    return path
