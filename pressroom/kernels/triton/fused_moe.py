"""Fused mixture-of-experts on the GPU: the (token, expert) pairs sorted by expert and padded to blocks of
BLOCK_M rows, then two grouped GEMMs over those blocks, each block reading one expert's weights:
gate and up with SiLU-and-mul in the same pass, then down with each pair's top-k weight applied; a sum
over the k pairs of a token gives its output.

Shapes are static for a given (tokens, top_k, experts): the padded pair list has its upper bound
pairs + min(experts, pairs) * (BLOCK_M - 1) slots, and blocks past the used ones carry expert -1 and exit.
Launch configurations come from a sweep committed per shape and GPU (moe_configs/, written by
benchmarks/gpu/sweep_fused_moe.py), looked up by the token count nearest to the call's.

Small steps (batch-1 decode) take token-major GEMVs instead (`MoeLaunch.gemv`): each (token, expert) pair's
gate/up and activation in one launch, then each token's down projections over its k pairs, weighted and summed,
in a second: no alignment and no separate top-k sum, two launches where the grouped path takes four.

Shared experts (DeepSeek's, Qwen2-MoE's) fold into either path as extra experts every token routes to
(`SharedExperts`): read in place from the dense MLP's gate/up and down weights, in chunks of the routed experts'
intermediate size, so one pair of launches computes the routed and the shared experts.

`fused_moe_fp4`: the same two grouped GEMMs over FP4 experts (kernels/fp4_moe.py: MXFP4 or NVFP4, weight-only).
Each weight tile is read packed and dequantized in registers (quant_gemv.py's unpacking: the low nibbles of a
byte meet the activations' even inputs, the high nibbles the odd ones, two tl.dot per tile), so the experts are
never widened in memory. Not measured on a GPU yet (no sweep: default launches).

Both take gpt-oss's options: expert biases (gate/up's added before the activation, down's before the top-k
weight) and its clamped SwiGLU (kernels/moe_activation.py) in the gate/up pass instead of SwiGLU; and
DeepSeek-V4's SwiGLU on clamped halves (LimitedSwiglu).

`fused_moe_relu2`: experts with no gate half (Nemotron-H): the first GEMM reads only the up rows and applies
relu(up)² in the same pass; the down pass is fused_moe's.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from pressroom.kernels.fp4_moe import Fp4Experts
from pressroom.kernels.moe_activation import ClampedSwiglu, LimitedSwiglu
from pressroom.kernels.triton.quant_gemv import as_words, fp4_blocks, fp4_weights

# The gate/up pass's activation (the kernels' ACTIVATION constexpr).
SWIGLU, CLAMPED_SWIGLU, LIMITED_SWIGLU = 0, 1, 2

SWEEP_DIR = Path(__file__).with_name("moe_configs")
# Up to this many pairs one Triton program sorts them (one launch: decode steps are launch-bound);
# beyond, torch's sort, whose dozen launches a large step's GEMMs amortise.
ALIGN_IN_ONE_PROGRAM_MAX_PAIRS = 4096


# Without a swept choice, steps of up to this many tokens take the token-major GEMVs.
GEMV_MAX_TOKENS = 4
# The down-sum GEMV's tile over a token's experts holds at most this many weights (64 a thread at 4 warps): its input
# tile is the launch's block_k cut to fit (a wider one spills registers).
DOWN_TILE_WEIGHTS = 8192


@dataclass(slots=True, frozen=True)
class MoeLaunch:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False  # token-major GEMVs (block_m unused) instead of the aligned grouped GEMMs


@dataclass(slots=True, frozen=True)
class SharedExperts:
    """A dense SwiGLU MLP's weights read as `count` extra experts that every token routes to: gate/up
    [2 * count * inter, hidden] (all gate rows, then all up rows) and down [hidden, count * inter], `inter` the
    routed experts' intermediate size. Extra expert j (id: routed experts + j) is rows [j * inter, (j + 1) * inter)
    of each half of gate/up and the same columns of down: the chunks' outputs sum to the MLP's."""
    w13: torch.Tensor
    w2: torch.Tensor
    count: int

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        _, double_inter, hidden = w13.shape
        width = self.count * double_inter // 2
        if (tuple(self.w13.shape) != (2 * width, hidden) or tuple(self.w2.shape) != (hidden, width)
                or self.w13.dtype != w13.dtype or self.w2.dtype != w2.dtype
                or self.w13.stride(1) != 1 or self.w2.stride(1) != 1):
            raise ValueError(f"shared experts of shapes {tuple(self.w13.shape)} and {tuple(self.w2.shape)} "
                             f"({self.w13.dtype}) are not {self.count} experts of the routed experts' shape "
                             f"{tuple(w13.shape[1:])} ({w13.dtype}) with unit column stride.")


def sweep_path(experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype | str, gpu: str,
               shared: int = 0) -> Path:
    """The launch table of one MoE shape (with `shared` folded shared experts) and weight form (a dtype, or a name
    such as fused_moe_fp8's "fp8_block128") on one GPU: the one key every table is filed and found under."""
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    folded = f"_S{shared}" if shared else ""
    return SWEEP_DIR / f"E{experts}_N{inter}_H{hidden}_K{top_k}{folded}_{dtype_name}_{gpu.replace(' ', '_')}.json"


@functools.cache
def load_sweep(path: Path) -> dict[int, MoeLaunch]:
    """The sweep's best launch per token count; empty where no sweep was committed for this shape. (A table swept
    before the GEMVs were candidates keeps its grouped launches until it is swept again.)"""
    if not path.exists():
        return {}
    best = json.loads(path.read_text())["best"]
    return {int(tokens): MoeLaunch(**launch) for tokens, launch in best.items()}


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def default_launch(tokens: int, top_k: int, experts: int) -> MoeLaunch:
    """Without a sweep: rows per block grow with the pairs an expert receives on average."""
    per_expert = tokens * top_k / experts
    if per_expert <= 16:
        return MoeLaunch(16, 64, 64, 4, 3)
    if per_expert <= 64:
        return MoeLaunch(32, 64, 64, 4, 3)
    return MoeLaunch(64, 128, 64, 8, 3)


def gemv_launch() -> MoeLaunch:
    """The token-major GEMVs without a sweep: narrow column blocks (many programs for one token's few pairs),
    wide input tiles, two tiles in flight (as the dense GEMVs' loop). 8 rows a program: the best of 8, 16 and 32 at
    1-4 tokens of DeepSeek-V2-Lite's and Qwen3-30B-A3B's experts on an H100 (2026-12-07: 53.6 / 32.6 us a layer at
    one token, 2.58 / 2.32 TB/s; the kernels before this loop took 126.1 / 74.6)."""
    return MoeLaunch(1, 8, 256, 4, 2, gemv=True)


def choose_launch(tokens: int, w13: torch.Tensor, top_k: int, shared: int = 0) -> MoeLaunch:
    """The swept launch for this shape nearest to `tokens` (top_k counts the routed experts; `shared`: folded shared
    experts); without a sweep, the GEMVs up to GEMV_MAX_TOKENS tokens, else default_launch."""
    experts, double_inter, hidden = w13.shape
    table = {}
    if w13.device.type == "cuda":  # Triton's interpreter: correctness only, the defaults
        table = load_sweep(sweep_path(experts, double_inter // 2, hidden, top_k, w13.dtype,
                                      _gpu_name(w13.device.index or 0), shared))
    if table:
        return nearest_launch(table, tokens)
    return gemv_launch() if tokens <= GEMV_MAX_TOKENS else default_launch(tokens, top_k + shared, experts + shared)


def nearest_launch(table: dict[int, MoeLaunch], tokens: int) -> MoeLaunch:
    """The launch swept at the token count nearest to `tokens` (the smaller on a tie)."""
    return table[min(table, key=lambda n: (abs(n - tokens), n))]


@triton.jit
def _pick_top_k(choice, scores, experts, weights_ptr, ids_ptr, row, scale, TOP_K: tl.constexpr,
                RENORMALIZE: tl.constexpr, BINS: tl.constexpr):
    """The TOP_K best of `choice` (every real expert above -inf; others -inf), stored at weights/ids row `row` in
    expert order: their `scores` (renormalised to sum to one where asked) times `scale`, and their `experts` ids."""
    lanes = tl.arange(0, BINS)
    picked = tl.zeros((BINS,), dtype=tl.int1)
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(tl.where(picked, float("-inf"), choice), axis=0)
        picked = picked | (lanes == best)
    total = tl.sum(tl.where(picked, scores, 0.0), axis=0)
    norm = scale / (total + 1e-20) if RENORMALIZE else scale
    rank = tl.cumsum(picked.to(tl.int32), axis=0) - 1  # chosen experts in expert order
    tl.store(weights_ptr + row + rank, scores * norm, mask=picked)
    tl.store(ids_ptr + row + rank, experts, mask=picked)


@triton.jit
def _store_shared(weights_ptr, ids_ptr, row, token, x_ptr, gate_ptr, stride_x, hidden, num_experts,
                  NUM_SHARED: tl.constexpr, SHARED_GATE: tl.constexpr, BLOCK_H: tl.constexpr, BINS: tl.constexpr):
    """The NUM_SHARED shared experts (ids num_experts ..) after a token's top-k: weighted 1, or with SHARED_GATE
    sigmoid(x . gate) (Qwen2-MoE's shared expert gate, over the token's hidden features)."""
    shared_weight = 1.0
    if SHARED_GATE:
        dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < hidden
            dot += (tl.load(x_ptr + token.to(tl.int64) * stride_x + h, mask=h_ok, other=0.0).to(tl.float32)
                    * tl.load(gate_ptr + h, mask=h_ok, other=0.0).to(tl.float32))
        shared_weight = 1.0 / (1.0 + tl.exp(-tl.sum(dot, axis=0)))
    j = tl.arange(0, BINS)
    is_shared = j < NUM_SHARED
    tl.store(weights_ptr + row + j, tl.zeros((BINS,), dtype=tl.float32) + shared_weight, mask=is_shared)
    tl.store(ids_ptr + row + j, num_experts + j, mask=is_shared)


@triton.jit
def _finite_choice(choice, ok):
    """Every real expert above -inf, even a NaN or -inf score (garbage activations, as dummy weights can make), so
    each round of the top-k picks a new one: always top_k distinct experts, never an unwritten id."""
    choice = tl.where(choice == choice, tl.maximum(choice, -3.0e38), -3.0e38)
    return tl.where(ok, choice, float("-inf"))


@triton.jit
def _route_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, x_ptr, gate_ptr, num_experts, stride_logits,
                       stride_x, hidden, scale, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RENORMALIZE: tl.constexpr, BINS: tl.constexpr, NUM_SHARED: tl.constexpr,
                       SHARED_GATE: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token: scores (softmax or sigmoid), the top-k by score plus the correction bias, the chosen
    scores as weights (renormalised to sum to one where asked), times the routed scaling factor; then the
    NUM_SHARED shared experts (_store_shared)."""
    token = tl.program_id(0)
    e = tl.arange(0, BINS)
    ok = e < num_experts
    x = tl.load(logits_ptr + token * stride_logits + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = tl.exp(x - tl.max(x, axis=0))
        scores = scores / tl.sum(scores, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    row = token * (TOP_K + NUM_SHARED)
    _pick_top_k(_finite_choice(choice, ok), scores, e, weights_ptr, ids_ptr, row, scale, TOP_K, RENORMALIZE, BINS)
    if NUM_SHARED > 0:
        _store_shared(weights_ptr, ids_ptr, row + TOP_K, token, x_ptr, gate_ptr, stride_x, hidden, num_experts,
                      NUM_SHARED, SHARED_GATE, BLOCK_H, BINS)


@triton.jit
def _route_grouped_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, x_ptr, gate_ptr, num_experts, stride_logits,
                          stride_x, hidden, scale, TOP_K: tl.constexpr, SIGMOID: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr,
                          SHARED_GATE: tl.constexpr, BLOCK_H: tl.constexpr, GROUPS: tl.constexpr,
                          PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP2_SUM: tl.constexpr,
                          GROUP_BINS: tl.constexpr, MEMBER_BINS: tl.constexpr, SHARED_BINS: tl.constexpr):
    """_route_topk_kernel for grouped routers (DeepSeek-V2's group_limited_greedy, V3's noaux_tc): the experts laid
    out [group, member]; a group scores its best (V2) or its two best (TOP2_SUM, V3) choices' sum; only the
    TOPK_GROUPS best groups' experts compete in the top-k."""
    token = tl.program_id(0)
    group = tl.arange(0, GROUP_BINS)
    member = tl.arange(0, MEMBER_BINS)
    ok = (group < GROUPS)[:, None] & (member < PER_GROUP)[None, :]
    e = group[:, None] * PER_GROUP + member[None, :]
    x = tl.load(logits_ptr + token * stride_logits + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = scores / tl.sum(tl.sum(scores, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = _finite_choice(choice, ok)
    group_score = tl.max(choice, axis=1)
    if TOP2_SUM:  # the best plus the best of the rest (the same value again where two tie)
        first = tl.argmax(choice, axis=1)
        group_score += tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
    group_score = tl.where(group < GROUPS, group_score, float("-inf"))
    kept = tl.zeros((GROUP_BINS,), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.argmax(tl.where(kept, float("-inf"), group_score), axis=0)
        kept = kept | (group == best)
    choice = tl.where(kept[:, None], choice, float("-inf"))
    bins: tl.constexpr = GROUP_BINS * MEMBER_BINS
    row = token * (TOP_K + NUM_SHARED)
    _pick_top_k(tl.reshape(choice, (bins,)), tl.reshape(scores, (bins,)), tl.reshape(e, (bins,)), weights_ptr,
                ids_ptr, row, scale, TOP_K, RENORMALIZE, bins)
    if NUM_SHARED > 0:
        _store_shared(weights_ptr, ids_ptr, row + TOP_K, token, x_ptr, gate_ptr, stride_x, hidden, num_experts,
                      NUM_SHARED, SHARED_GATE, BLOCK_H, SHARED_BINS)


def route_topk(logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool, scaling: float,
               correction_bias: torch.Tensor | None = None, shared: int = 0,
               shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None,
               groups: tuple[int, int, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in one launch: weights (fp32) and ids (int32, as the alignment reads them), [tokens, top_k +
    shared] each. `groups` (num_groups, topk_groups, top2_sum): a grouped router's expert groups. The last `shared`
    columns are the shared experts (ids experts ..), weighted 1, or sigmoid(x . gate) with `shared_gate` (x [tokens,
    H], gate [1, H] or [H])."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k + shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + shared, dtype=torch.int32, device=logits.device)
    bias = correction_bias if correction_bias is not None else weights
    x, gate = shared_gate if shared_gate is not None else (weights, weights)
    if shared_gate is not None and (x.stride(-1) != 1 or gate.numel() != x.shape[1] or not gate.is_contiguous()):
        raise ValueError(f"the shared expert's gate {tuple(gate.shape)} does not fit tokens {tuple(x.shape)}.")
    args = (logits, bias, weights, ids, x, gate, experts, logits.stride(0), x.stride(0), x.shape[-1], scaling)
    common = dict(TOP_K=top_k, SIGMOID=sigmoid, HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
                  NUM_SHARED=shared, SHARED_GATE=shared_gate is not None, BLOCK_H=1024,
                  num_warps=4 if experts > 256 else 1)
    if groups is None or groups[0] == 1:
        _route_topk_kernel[(tokens,)](*args, BINS=max(16, triton.next_power_of_2(max(experts, shared))), **common)
        return weights, ids
    num_groups, topk_groups, top2_sum = groups
    if experts % num_groups:
        raise ValueError(f"{experts} experts do not split into {num_groups} groups.")
    per_group = experts // num_groups
    _route_grouped_kernel[(tokens,)](*args, GROUPS=num_groups, PER_GROUP=per_group, TOPK_GROUPS=topk_groups,
                                     TOP2_SUM=top2_sum, GROUP_BINS=max(2, triton.next_power_of_2(num_groups)),
                                     MEMBER_BINS=max(8, triton.next_power_of_2(per_group)),
                                     SHARED_BINS=max(16, triton.next_power_of_2(shared)), **common)
    return weights, ids


def max_padded_pairs(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for the worst case: every expert that receives a pair (at most min(experts, pairs)) wastes up
    to block_m - 1 padding slots."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [tokens, k]: expert ids local to this rank (-1: another rank's expert). Returns slots
    [max_padded] (pair index t * k + j grouped by expert, each expert's run padded to a multiple of
    block_m with tokens * k) and block_expert [max_padded // block_m] (each block's expert; -1: unused).
    No host sync: every size is known from the shapes."""
    if ids.numel() <= ALIGN_IN_ONE_PROGRAM_MAX_PAIRS:
        return align_in_one_program(ids, num_experts, block_m)
    return align_with_torch(ids, num_experts, block_m)


def align_with_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs, device = ids.numel(), ids.device
    flat = ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # other ranks' pairs sort last
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # bincount would sync with the host
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in the sorted order
    max_padded = max_padded_pairs(pairs, num_experts, block_m)
    expert = sorted_key.clamp(max=num_experts - 1)
    dest = ends[expert] - padded[expert] + torch.arange(pairs, device=device) - first[expert]
    dest = torch.where(sorted_key < num_experts, dest, max_padded)  # dropped pairs land in a spare slot
    slots = torch.full((max_padded + 1,), pairs, dtype=torch.int32, device=device)
    slots.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(max_padded // block_m, device=device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return slots[:max_padded], torch.where(block_expert < num_experts, block_expert, -1)


@triton.jit
def _align_kernel(ids_ptr, counters_ptr, slots_ptr, block_expert_ptr, num_pairs, num_experts, max_padded,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """One program: count each expert's pairs (atomics), lay the experts' padded runs end to end, pad
    each run's tail, then hand every pair the next free slot of its expert's run (atomics again: the
    order inside a run is arbitrary, the arithmetic of each row is not)."""
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    tl.store(counters_ptr + bins, tl.zeros((BINS,), dtype=tl.int32))
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        e = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=-1)
        e = tl.where(e < num_experts, e, -1)  # an id past the experts is dropped, never written through
        tl.atomic_add(counters_ptr + e, 1, mask=e >= 0)
    tl.debug_barrier()
    counts = tl.load(counters_ptr + bins, volatile=True)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    begins = ends - padded
    tl.store(counters_ptr + BINS + bins, begins)  # each run's next free slot
    for start in range(0, max_padded, BLOCKS_CHUNK * BLOCK_M):  # a block's expert: the runs ended before it
        block = start // BLOCK_M + tl.arange(0, BLOCKS_CHUNK)
        expert = tl.sum((ends[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, tl.where(expert < num_experts, expert, -1),
                 mask=block * BLOCK_M < max_padded)
    tail = tl.arange(0, BLOCK_M)
    tl.store(slots_ptr + (begins + counts)[:, None] + tail[None, :], tl.zeros((BINS, BLOCK_M), tl.int32) + num_pairs,
             mask=tail[None, :] < (padded - counts)[:, None])
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pair = start + lanes
        e = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        e = tl.where(e < num_experts, e, -1)
        dest = tl.atomic_add(counters_ptr + BINS + e, 1, mask=e >= 0)
        tl.store(slots_ptr + dest, pair, mask=e >= 0)


def align_in_one_program(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = ids.numel()
    max_padded = max_padded_pairs(pairs, num_experts, block_m)
    bins = max(16, triton.next_power_of_2(num_experts))
    slots = torch.empty(max_padded, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=ids.device)
    counters = torch.empty(2 * bins, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1).to(torch.int32)
    _align_kernel[(1,)](flat, counters, slots, block_expert, pairs, num_experts, max_padded, BLOCK_M=block_m,
                        BINS=bins, CHUNK=256, BLOCKS_CHUNK=64, num_warps=8)
    return slots, block_expert


def canonical_layout(slots: torch.Tensor, block_expert: torch.Tensor, block_m: int) -> torch.Tensor:
    """`slots` with each expert's run sorted (its pairs in pair order, then its padding) and unused blocks
    (never read) set to -1: the one layout both alignments describe, whatever order the atomics chose."""
    out = slots.clone()
    experts = block_expert.tolist()
    start = 0
    for i in range(1, len(experts) + 1):
        if i == len(experts) or experts[i] != experts[start]:
            run = slice(start * block_m, i * block_m)
            out[run] = slots[run].sort().values if experts[start] >= 0 else -1
            start = i
    return out


@triton.jit
def _add_bias(acc, acc_up, bias_ptr, expert, stride_be, cols, col_ok, n_out, GATED: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """The expert's bias row over `cols` added to acc (and, GATED, its up half, n_out further on, to acc_up)."""
    if HAS_BIAS:
        row = bias_ptr + expert.to(tl.int64) * stride_be + cols
        acc += tl.load(row, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(row + n_out, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc, acc_up


@triton.jit
def _gated(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """SWIGLU; CLAMPED_SWIGLU (gpt-oss): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g); LIMITED_SWIGLU
    (DeepSeek-V4): silu(g) * clamp(up, -limit, limit); g the gate clamped above at limit in both."""
    if ACTIVATION == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    if ACTIVATION == 2:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _block_pairs(pid_m, pid_n, slots_ptr, num_pairs, top_k, n_out, A_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Block pid_m's pair slots (num_pairs: padding), which of them are real, the activation row each reads (its
    token's where A_BY_TOKEN), and block pid_n's output columns with which of them are real."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    valid = slot < num_pairs
    a_row = slot // top_k if A_BY_TOKEN else slot
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return slot, valid, a_row, cols, cols < n_out


@triton.jit
def _store_pairs(acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, slot, valid, cols, col_ok, n_out, stride_c,
                 stride_be, alpha, limit, GATED: tl.constexpr, MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACTIVATION: tl.constexpr):
    """The block's products out to c's pair rows: plus the expert's bias, through the gated activation (GATED:
    acc the gate, acc_up the up projection), times each pair's top-k weight (MUL_WEIGHTS)."""
    acc, acc_up = _add_bias(acc, acc_up, bias_ptr, expert, stride_be, cols, col_ok, n_out, GATED, HAS_BIAS)
    if GATED:
        acc = _gated(acc, acc_up, alpha, limit, ACTIVATION)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + slot, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + slot.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _expert_weights(w_ptr, expert, stride_we, stride_wn, n_out, shared_ptr, num_routed, stride_sn, shared_chunk,
                    shared_up, HAS_SHARED: tl.constexpr):
    """Expert `expert`'s weight matrix: its first row, the stride between rows and the offset of its up rows. With
    HAS_SHARED, ids from num_routed on are chunks of the shared experts' matrix (shared_ptr; chunk j starts
    j * shared_chunk elements in, its up rows shared_up rows below its gate rows)."""
    base = w_ptr + expert.to(tl.int64) * stride_we
    stride_n = stride_wn
    up_rows = n_out
    if HAS_SHARED:
        if expert >= num_routed:
            base = shared_ptr + (expert - num_routed).to(tl.int64) * shared_chunk
            stride_n = stride_sn
            up_rows = shared_up
    return base, stride_n, up_rows.to(tl.int64) * stride_n


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, weights_ptr, bias_ptr,
                     n_out, k_in, num_pairs, stride_a, stride_we, stride_wn, stride_c, stride_be, top_k, alpha, limit,
                     shared_ptr, num_routed, stride_sn, shared_chunk, shared_up,
                     A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr = False,
                     ACTIVATION: tl.constexpr = 0, HAS_SHARED: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the used ones (a Triton helper cannot end its caller: the exit stays here)
        return
    slot, valid, a_row, cols, col_ok = _block_pairs(pid_m, pid_n, slots_ptr, num_pairs, top_k, n_out, A_BY_TOKEN,
                                                    BLOCK_M, BLOCK_N)
    w_base, stride_n, up_offset = _expert_weights(w_ptr, expert, stride_we, stride_wn, n_out, shared_ptr, num_routed,
                                                  stride_sn, shared_chunk, shared_up, HAS_SHARED)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_a + ks[None, :]
    w_ptrs = w_base + tl.where(col_ok, cols, 0).to(tl.int64)[None, :] * stride_n + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k0 + ks < k_in
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_pairs(acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, slot, valid, cols, col_ok, n_out, stride_c,
                 stride_be, alpha, limit, GATED, MUL_WEIGHTS, HAS_BIAS, ACTIVATION)


@triton.jit
def _gemv_gate_up(a_row_ptr, w_rows, up_offset, k_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    """One activation row (k_in inputs) times BLOCK_N gate rows (pointers to each row's first input) and the up rows
    up_offset further on: fp32 [BLOCK_N] each. As kernels/triton/gemv.py's loop: both tiles load in one iteration
    (sm_90's compile keeps them in registers: no shared-memory stages), products add up elementwise and are summed
    across K once at the end. Rows past the matrix point at a
    real row and are masked when stored."""
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_row_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_gate = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        w_up = tl.load(w_rows + up_offset + ks[None, :], mask=k_ok[None, :], other=0.0)
        gate += w_gate.to(tl.float32) * a
        up += w_up.to(tl.float32) * a
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _moe_up_gemv_kernel(x_ptr, w_ptr, mid_ptr, ids_ptr, bias_ptr, n_out, k_in, num_experts, stride_x, stride_we,
                        stride_wn, stride_mid, stride_be, top_k, alpha, limit, shared_ptr, num_routed, stride_sn,
                        shared_chunk, shared_up, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                        HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr):
    """One (token, expert) pair's gate and up rows [pid_n's BLOCK_N columns] over its token, plus the expert's bias,
    through the gated activation, out to mid's pair row. A pair of another rank's expert (-1) is skipped."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    w_base, stride_n, up_offset = _expert_weights(w_ptr, expert, stride_we, stride_wn, n_out, shared_ptr, num_routed,
                                                  stride_sn, shared_chunk, shared_up, HAS_SHARED)
    w_rows = w_base + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_n
    gate, up = _gemv_gate_up(x_ptr + (pair // top_k).to(tl.int64) * stride_x, w_rows, up_offset, k_in, BLOCK_N,
                             BLOCK_K, STAGES)
    gate, up = _add_bias(gate[None, :], up[None, :], bias_ptr, expert, stride_be, cols, col_ok, n_out, True, HAS_BIAS)
    mid = _gated(gate, up, alpha, limit, ACTIVATION)
    tl.store(mid_ptr + pair.to(tl.int64) * stride_mid + cols[None, :], mid.to(mid_ptr.dtype.element_ty),
             mask=col_ok[None, :])


@triton.jit
def _moe_down_sum_gemv_kernel(mid_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, bias_ptr, n_out, k_in, num_experts,
                              stride_mid, stride_we, stride_wn, stride_out, stride_be, shared_ptr, num_routed,
                              stride_sn, shared_chunk, TOP_K: tl.constexpr, PAIRS: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """One token's output [pid_n's BLOCK_N columns]: the sum over its TOP_K pairs of the pair's top-k weight times
    (its expert's down rows over the pair's mid row, plus the expert's bias), in fp32, rounded once. All TOP_K
    experts' tiles load in one iteration (PAIRS: TOP_K rounded up to a power of two): a token's few programs keep
    TOP_K times the bytes in flight of one expert at a time. Pairs of another rank's experts (-1) add nothing."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    j = tl.arange(0, PAIRS)
    pair = token.to(tl.int64) * TOP_K + j
    expert = tl.load(ids_ptr + pair, mask=j < TOP_K, other=-1)
    here = (expert >= 0) & (expert < num_experts)
    expert = tl.where(here, expert, 0).to(tl.int64)
    base = w_ptr + expert * stride_we
    stride_n = tl.zeros((PAIRS,), dtype=tl.int64) + stride_wn
    if HAS_SHARED:  # ids from num_routed on: chunks of the shared experts' matrix (as _expert_weights reads them)
        shared = expert >= num_routed
        base = tl.where(shared, shared_ptr + (expert - num_routed) * shared_chunk, base)
        stride_n = tl.where(shared, stride_sn, stride_n)
    w_rows = base[:, None] + tl.where(col_ok, cols, 0).to(tl.int64)[None, :] * stride_n[:, None]  # [PAIRS, BLOCK_N]
    mid_rows = mid_ptr + pair * stride_mid
    prods = tl.zeros((PAIRS, BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed across K once, after the loop
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = here[:, None] & (ks < k_in)[None, :]  # [PAIRS, BLOCK_K]
        a = tl.load(mid_rows[:, None] + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, :, None] + ks[None, None, :], mask=k_ok[:, None, :], other=0.0).to(tl.float32)
        prods += w * a[:, None, :]
    acc = tl.sum(prods, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert[:, None] * stride_be + cols[None, :], mask=here[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
    weight = tl.load(weights_ptr + pair, mask=here, other=0.0)
    total = tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              launch: MoeLaunch | None = None, all_local: bool = False, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: ClampedSwiglu | LimitedSwiglu | None = None,
              shared: SharedExperts | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights (fp32) and ids [T, k], ids local to w13's experts
    (-1: another rank's expert; `all_local`: there are none). Returns [T, H] in x's dtype. gpt-oss: biases
    w13_bias [E, 2I] and w2_bias [E, H], and its clamped SwiGLU as `activation`; DeepSeek-V4: its LimitedSwiglu.
    `shared`: shared experts folded in as experts E .. E + count - 1, which ids must name (with their weights)."""
    tokens, hidden = x.shape
    routed, double_inter, _ = w13.shape
    inter, k = double_inter // 2, ids.shape[1]
    count = 0 if shared is None else shared.count
    if shared is not None:
        shared.check(w13, w2)
        if w13_bias is not None or w2_bias is not None or activation is not None:
            raise ValueError("shared experts fold only into SwiGLU experts without biases.")
    cfg = launch or choose_launch(tokens, w13, k - count, count)
    flat_weights = weights.reshape(-1).float().contiguous()
    act = _activation_args(activation)
    b13, b2 = _bias_args(w13_bias, flat_weights), _bias_args(w2_bias, flat_weights)
    s13, s2 = _shared_args(shared, w13, w2, routed, inter)
    mid = torch.empty(tokens * k, inter, dtype=x.dtype, device=x.device)  # pairs no program holds are never read
    if cfg.gemv:
        return _gemv_moe(x, w13, w2, mid, flat_weights, ids, act, b13, b2, s13, s2, routed + count, cfg)
    slots, block_expert = align_by_expert(ids, routed + count, cfg.block_m)
    # every row is written unless another rank holds some pairs: those must add zero
    out = (torch.empty if all_local else torch.zeros)(tokens * k, hidden, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models keep fp32 products
    common = dict(PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, HAS_SHARED=shared is not None)
    grid = (block_expert.numel(), triton.cdiv(inter, cfg.block_n))
    _moe_gemm_kernel[grid](x, w13, mid, slots, block_expert, flat_weights, b13[0], inter, hidden, tokens * k,
                           x.stride(0), w13.stride(0), w13.stride(1), mid.stride(0), b13[1], k, *act[:2], *s13,
                           A_BY_TOKEN=True, GATED=True, MUL_WEIGHTS=False, EVEN_K=hidden % cfg.block_k == 0,
                           HAS_BIAS=b13[2], ACTIVATION=act[2], **common)
    grid = (block_expert.numel(), triton.cdiv(hidden, cfg.block_n))
    _moe_gemm_kernel[grid](mid, w2, out, slots, block_expert, flat_weights, b2[0], hidden, inter, tokens * k,
                           mid.stride(0), w2.stride(0), w2.stride(1), out.stride(0), b2[1], k, *act[:2], *s2,
                           A_BY_TOKEN=False, GATED=False, MUL_WEIGHTS=True, EVEN_K=inter % cfg.block_k == 0,
                           HAS_BIAS=b2[2], **common)
    return sum_top_k(out.view(tokens, k, hidden))


def _gemv_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, mid: torch.Tensor, flat_weights: torch.Tensor,
              ids: torch.Tensor, act: tuple, b13: tuple, b2: tuple, s13: tuple, s2: tuple, experts: int,
              cfg: MoeLaunch) -> torch.Tensor:
    """fused_moe's token-major path: the pairs' gate/up GEMVs, then each token's down GEMVs summed (two launches)."""
    tokens, hidden = x.shape
    inter, k = mid.shape[1], ids.shape[1]
    flat_ids = ids.reshape(-1).to(torch.int32)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    common = dict(HAS_SHARED=experts > w13.shape[0], BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                  num_warps=cfg.num_warps)
    _moe_up_gemv_kernel[(tokens * k, triton.cdiv(inter, cfg.block_n))](
        x, w13, mid, flat_ids, b13[0], inter, hidden, experts, x.stride(0), w13.stride(0), w13.stride(1),
        mid.stride(0), b13[1], k, *act[:2], *s13, HAS_BIAS=b13[2], ACTIVATION=act[2], BLOCK_K=cfg.block_k, **common)
    pairs = triton.next_power_of_2(k)
    down_k = max(16, min(cfg.block_k, DOWN_TILE_WEIGHTS // (pairs * cfg.block_n)))
    _moe_down_sum_gemv_kernel[(tokens, triton.cdiv(hidden, cfg.block_n))](
        mid, w2, out, flat_ids, flat_weights, b2[0], hidden, inter, experts, mid.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), b2[1], *s2[:4], TOP_K=k, PAIRS=pairs, HAS_BIAS=b2[2], BLOCK_K=down_k, **common)
    return out


def _shared_args(shared: SharedExperts | None, w13: torch.Tensor, w2: torch.Tensor, routed: int, inter: int
                 ) -> tuple[tuple, tuple]:
    """The kernels' (shared_ptr, num_routed, stride_sn, shared_chunk, shared_up) for the gate/up and the down pass;
    without shared experts, placeholders never read."""
    if shared is None:
        return (w13, routed, w13.stride(1), 0, inter), (w2, routed, w2.stride(1), 0, inter)
    width = shared.count * inter
    return ((shared.w13, routed, shared.w13.stride(0), inter * shared.w13.stride(0), width),
            (shared.w2, routed, shared.w2.stride(0), inter, width))


@triton.jit
def _relu2(x):
    x = tl.maximum(x, 0.0)
    return x * x


@triton.jit
def _moe_up_relu2_kernel(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, bias_ptr, n_out, k_in, num_pairs, stride_a,
                         stride_we, stride_wn, stride_c, stride_be, top_k, EVEN_K: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The first GEMM of experts with no gate half: each pair's token times its expert's up rows (n_out of them),
    plus the expert's bias, through ReLU², out to c's pair row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slot, valid, a_row, cols, col_ok = _block_pairs(pid_m, pid_n, slots_ptr, num_pairs, top_k, n_out, True,
                                                    BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + tl.where(col_ok, cols, 0)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k0 + ks < k_in
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc, _ = _add_bias(acc, acc, bias_ptr, expert, stride_be, cols, col_ok, n_out, False, HAS_BIAS)
    _store_pairs(_relu2(acc), acc, c_ptr, bias_ptr, bias_ptr, expert, slot, valid, cols, col_ok, n_out, stride_c,
                 stride_be, 1.0, 0.0, False, False, False, False)


def fused_moe_relu2(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    launch: MoeLaunch | None = None, all_local: bool = False, w1_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe for experts with no gate half (Nemotron-H): x [T, H]; w1 [E, I, H] the up matrices, relu(up)²
    between them and w2 [E, H, I]; optional biases w1_bias [E, I], w2_bias [E, H]; weights (fp32) and ids [T, k]
    as in fused_moe. Returns [T, H] in x's dtype. Default launches (no sweep for these experts yet)."""
    tokens, hidden = x.shape
    experts, inter, _ = w1.shape
    if w1.shape[2] != hidden or w2.shape != (experts, hidden, inter):
        raise ValueError(f"experts of shapes {tuple(w1.shape)} and {tuple(w2.shape)} do not fit {hidden} hidden "
                         "features.")
    k = ids.shape[1]
    pairs = tokens * k
    cfg = launch or default_launch(tokens, k, experts)
    slots, block_expert = align_by_expert(ids, experts, cfg.block_m)
    mid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # pairs no block holds are never read
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    b1, b2 = _bias_args(w1_bias, flat_weights), _bias_args(w2_bias, flat_weights)
    grid = (block_expert.numel(), triton.cdiv(inter, cfg.block_n))
    _moe_up_relu2_kernel[grid](x, w1, mid, slots, block_expert, b1[0], inter, hidden, pairs, x.stride(0),
                               w1.stride(0), w1.stride(1), mid.stride(0), b1[1], k,
                               EVEN_K=hidden % cfg.block_k == 0, HAS_BIAS=b1[2], **common)
    grid = (block_expert.numel(), triton.cdiv(hidden, cfg.block_n))
    _moe_gemm_kernel[grid](mid, w2, out, slots, block_expert, flat_weights, b2[0], hidden, inter, pairs,
                           mid.stride(0), w2.stride(0), w2.stride(1), out.stride(0), b2[1], k, 1.0, 0.0,
                           *_shared_args(None, w1, w2, experts, inter)[1], A_BY_TOKEN=False, GATED=False,
                           MUL_WEIGHTS=True, EVEN_K=inter % cfg.block_k == 0,
                           HAS_BIAS=b2[2], **common)
    return sum_top_k(out.view(tokens, k, hidden))


def _activation_args(activation: ClampedSwiglu | LimitedSwiglu | None) -> tuple[float, float, int]:
    """(alpha, limit, ACTIVATION) for the kernels."""
    if activation is None:
        return 1.0, 0.0, SWIGLU
    if isinstance(activation, LimitedSwiglu):
        return 1.0, activation.limit, LIMITED_SWIGLU
    return activation.alpha, activation.limit, CLAMPED_SWIGLU


def _bias_args(bias: torch.Tensor | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(pointer, expert stride, HAS_BIAS) for the kernels; without a bias, a placeholder never read."""
    if bias is None:
        return placeholder, 0, False
    return bias, bias.stride(0), True


@triton.jit
def _fp4_dot(a_rows, w_rows, s_rows, g_rows, k0, col_ok, a_ok, k_in, PRECISION: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BB: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of activations (inputs from k0) times the FP4 weight rows' tile (w_rows: int32
    words), fp32."""
    k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + k[None, :], mask=a_ok[:, None] & (k < k_in)[None, :], other=0.0)
    w = fp4_weights(w_rows, s_rows, g_rows, k0, col_ok, k_in, BLOCK_N, BLOCK_K, BB).to(a.dtype)
    return tl.dot(a, tl.trans(w), input_precision=PRECISION)


@triton.jit
def _moe_fp4_gemm_kernel(a_ptr, w_ptr, s_ptr, g_ptr, c_ptr, slots_ptr, block_expert_ptr, weights_ptr, bias_ptr,
                         n_out, k_in, num_pairs, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_ge,
                         stride_gn, stride_c, stride_be, top_k, alpha, limit, A_BY_TOKEN: tl.constexpr,
                         GATED: tl.constexpr, MUL_WEIGHTS: tl.constexpr, PRECISION: tl.constexpr, BB: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0):
    """_moe_gemm_kernel over FP4 weights: packed [E, N, K / 2] read as int32 words [E, N, K / 8] (strides in
    words), block scales [E, N, K / (2 * BB)], NVFP4's per-row global scales [E, N] (MXFP4: unread)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the used ones (a Triton helper cannot end its caller: the exit stays here)
        return
    slot, valid, a_row, cols, col_ok = _block_pairs(pid_m, pid_n, slots_ptr, num_pairs, top_k, n_out, A_BY_TOKEN,
                                                    BLOCK_M, BLOCK_N)
    e = expert.to(tl.int64)
    n = tl.where(col_ok, cols, 0).to(tl.int64)[:, None]
    a_rows = a_ptr + a_row.to(tl.int64)[:, None] * stride_a
    w_rows = w_ptr + e * stride_we + n * stride_wn
    s_rows = s_ptr + e * stride_se + n * stride_sn
    g_rows = g_ptr + e * stride_ge + n * stride_gn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        acc += _fp4_dot(a_rows, w_rows, s_rows, g_rows, k0, col_ok, valid, k_in, PRECISION, BLOCK_N, BLOCK_K, BB)
        if GATED:  # the up rows lie n_out rows below the gate rows
            acc_up += _fp4_dot(a_rows, w_rows + n_out * stride_wn, s_rows + n_out * stride_sn,
                               g_rows + n_out * stride_gn, k0, col_ok, valid, k_in, PRECISION, BLOCK_N, BLOCK_K, BB)
    _store_pairs(acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, slot, valid, cols, col_ok, n_out, stride_c,
                 stride_be, alpha, limit, GATED, MUL_WEIGHTS, HAS_BIAS, ACTIVATION)


@triton.jit
def _fp4_block_sums(a_rows, a_ok, w_rows, s_rows, g_rows, k0, row_ok, k_in, ROWS: tl.constexpr,
                    BLOCK_K: tl.constexpr, BB: tl.constexpr):
    """Activation rows (a_rows [ROWS or 1]: each row's first input) times FP4 weight rows' tile of inputs from k0
    (fp4_blocks: a scale block's words in one thread): each block's products summed in its thread and scaled, fp32
    [ROWS, blocks]; the blocks are summed once, after the loop (the dense one-token GEMV's scheme)."""
    NB: tl.constexpr = BLOCK_K // (2 * BB)
    k = k0 + tl.arange(0, NB)[:, None] * (2 * BB) + tl.arange(0, 2 * BB)[None, :]
    a = tl.load(a_rows[:, None, None] + k[None, :, :], mask=a_ok[:, None, None] & (k < k_in)[None, :, :],
                other=0.0).to(tl.float32)
    values, scale = fp4_blocks(w_rows, s_rows, g_rows, k0, row_ok, k_in, ROWS, BLOCK_K, BB)
    return tl.sum(values * a, axis=2) * scale


@triton.jit
def _moe_fp4_up_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, mid_ptr, ids_ptr, bias_ptr, n_out, k_in, num_experts,
                            stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_mid,
                            stride_be, top_k, alpha, limit, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                            BB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_moe_up_gemv_kernel over FP4 experts (_moe_fp4_gemm_kernel's operands): gate's and up's tiles in one
    iteration, block sums kept apart until the loop ends."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    e = expert.to(tl.int64)
    n = tl.where(col_ok, cols, 0).to(tl.int64)[:, None]
    w_rows, s_rows, g_rows = w_ptr + e * stride_we + n * stride_wn, s_ptr + e * stride_se + n * stride_sn, \
        g_ptr + e * stride_ge + n * stride_gn
    one_row = tl.zeros((1,), dtype=tl.int64)
    a_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x + one_row
    gate = tl.zeros((BLOCK_N, BLOCK_K // (2 * BB)), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K // (2 * BB)), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        gate += _fp4_block_sums(a_row, one_row == 0, w_rows, s_rows, g_rows, k0, col_ok, k_in, BLOCK_N, BLOCK_K, BB)
        up += _fp4_block_sums(a_row, one_row == 0, w_rows + n_out * stride_wn, s_rows + n_out * stride_sn,
                              g_rows + n_out * stride_gn, k0, col_ok, k_in, BLOCK_N, BLOCK_K, BB)
    gate, up = _add_bias(tl.sum(gate, axis=1)[None, :], tl.sum(up, axis=1)[None, :], bias_ptr, expert, stride_be,
                         cols, col_ok, n_out, True, HAS_BIAS)
    mid = _gated(gate, up, alpha, limit, ACTIVATION)
    tl.store(mid_ptr + pair.to(tl.int64) * stride_mid + cols[None, :], mid.to(mid_ptr.dtype.element_ty),
             mask=col_ok[None, :])


@triton.jit
def _moe_fp4_down_sum_gemv_kernel(mid_ptr, w_ptr, s_ptr, g_ptr, out_ptr, ids_ptr, weights_ptr, bias_ptr, n_out, k_in,
                                  num_experts, stride_mid, stride_we, stride_wn, stride_se, stride_sn, stride_ge,
                                  stride_gn, stride_out, stride_be, TOP_K: tl.constexpr, PAIRS: tl.constexpr,
                                  HAS_BIAS: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr):
    """_moe_down_sum_gemv_kernel over FP4 experts: all TOP_K experts' tiles in one iteration, as PAIRS * BLOCK_N
    rows (row r: pair r // BLOCK_N's expert, column r % BLOCK_N), each reading its pair's mid row."""
    ROWS: tl.constexpr = PAIRS * BLOCK_N
    token = tl.program_id(0)
    r = tl.arange(0, ROWS)
    j = r // BLOCK_N
    cols = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    col_ok = cols < n_out
    pair = token.to(tl.int64) * TOP_K + j
    expert = tl.load(ids_ptr + pair, mask=j < TOP_K, other=-1)
    here = (expert >= 0) & (expert < num_experts)
    e = tl.where(here, expert, 0).to(tl.int64)
    n = tl.where(col_ok, cols, 0).to(tl.int64)
    w_rows, s_rows, g_rows = (w_ptr + e * stride_we + n * stride_wn)[:, None], \
        (s_ptr + e * stride_se + n * stride_sn)[:, None], (g_ptr + e * stride_ge + n * stride_gn)[:, None]
    sums = tl.zeros((ROWS, BLOCK_K // (2 * BB)), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        sums += _fp4_block_sums(mid_ptr + pair * stride_mid, here, w_rows, s_rows, g_rows, k0, here, k_in, ROWS,
                                BLOCK_K, BB)
    acc = tl.sum(sums, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + n, mask=here & col_ok, other=0.0).to(tl.float32)
    weighted = acc * tl.load(weights_ptr + pair, mask=here, other=0.0)
    total = tl.sum(tl.reshape(weighted, (PAIRS, BLOCK_N)), axis=0)
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + out_cols, total.to(out_ptr.dtype.element_ty),
             mask=out_cols < n_out)


def fp4_launch(tokens: int, top_k: int, experts: int) -> MoeLaunch:
    """The GEMVs up to GEMV_MAX_TOKENS tokens; beyond, default_launch's rows per block, 64 inputs a tile (whole
    MXFP4 blocks of 32 per tile). (No sweep for FP4 experts yet.)"""
    if tokens <= GEMV_MAX_TOKENS:
        return gemv_launch()
    launch = default_launch(tokens, top_k, experts)
    return MoeLaunch(launch.block_m, launch.block_n, 64, launch.num_warps, launch.num_stages)


def _fp4_operands(w: Fp4Experts, placeholder: torch.Tensor) -> tuple:
    """(words, scales, global scales, their strides: expert and row each) for the FP4 kernels; MXFP4's global
    scales a placeholder never read."""
    g = w.global_scale if w.global_scale is not None else w.scales
    g_strides = (g.stride(0), g.stride(1)) if w.global_scale is not None else (0, 0)
    words = as_words(w.packed)
    return (words, w.scales, g, words.stride(0), words.stride(1), w.scales.stride(0), w.scales.stride(1),
            *g_strides)


def fused_moe_fp4(x: torch.Tensor, w13: Fp4Experts, w2: Fp4Experts, weights: torch.Tensor, ids: torch.Tensor,
                  launch: MoeLaunch | None = None, all_local: bool = False, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: ClampedSwiglu | LimitedSwiglu | None = None
              ) -> torch.Tensor:
    """fused_moe with FP4 experts (kernels/fp4_moe.py): x [T, H]; w13 [E, 2I, H] and w2 [E, H, I] as Fp4Experts of
    one format; weights (fp32) and ids [T, k] local to the experts (-1: another rank's). Returns [T, H] in x's
    dtype. gpt-oss's dense biases and clamped SwiGLU as in fused_moe; small steps take the GEMVs, as fused_moe's."""
    tokens, hidden = x.shape
    experts, double_inter, _ = w13.shape
    inter, k = double_inter // 2, ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (experts, hidden, inter) or w13.block != w2.block:
        raise ValueError(f"FP4 experts of shapes {w13.shape} and {w2.shape} do not fit {hidden} hidden features.")
    pairs = tokens * k
    cfg = launch or fp4_launch(tokens, k, experts)
    if cfg.block_k % w13.block:
        raise ValueError(f"a launch for FP4 experts reads whole blocks of {w13.block} inputs; block_k {cfg.block_k} "
                         "is not a multiple.")
    mid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    alpha, limit, form = _activation_args(activation)
    (b13, b13_stride, has_b13), (b2, b2_stride, has_b2) = (_bias_args(w13_bias, flat_weights),
                                                          _bias_args(w2_bias, flat_weights))
    up_ops, down_ops = _fp4_operands(w13, flat_weights), _fp4_operands(w2, flat_weights)
    if cfg.gemv:
        flat_ids = ids.reshape(-1).to(torch.int32)
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        common = dict(BB=w13.block // 2, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
        _moe_fp4_up_gemv_kernel[(pairs, triton.cdiv(inter, cfg.block_n))](
            x, *up_ops[:3], mid, flat_ids, b13, inter, hidden, experts, x.stride(0), *up_ops[3:], mid.stride(0),
            b13_stride, k, alpha, limit, HAS_BIAS=has_b13, ACTIVATION=form, **common)
        top_k_pairs = triton.next_power_of_2(k)  # the down pass's tiles hold every pair's rows: fewer inputs a tile
        down_k = max(w13.block, min(cfg.block_k, DOWN_TILE_WEIGHTS // (top_k_pairs * cfg.block_n)))
        _moe_fp4_down_sum_gemv_kernel[(tokens, triton.cdiv(hidden, cfg.block_n))](
            mid, *down_ops[:3], out, flat_ids, flat_weights, b2, hidden, inter, experts, mid.stride(0),
            *down_ops[3:], out.stride(0), b2_stride, TOP_K=k, PAIRS=top_k_pairs, HAS_BIAS=has_b2,
            **(common | {"BLOCK_K": down_k}))
        return out
    slots, block_expert = align_by_expert(ids, experts, cfg.block_m)
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(PRECISION=precision, BB=w13.block // 2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    passes = ((x, up_ops, b13, b13_stride, has_b13, mid, inter, hidden, True),
              (mid, down_ops, b2, b2_stride, has_b2, out, hidden, inter, False))
    for a, ops, b, stride_be, has_bias, c, n_out, k_in, by_token in passes:
        grid = (block_expert.numel(), triton.cdiv(n_out, cfg.block_n))
        _moe_fp4_gemm_kernel[grid](a, *ops[:3], c, slots, block_expert, flat_weights, b, n_out, k_in, pairs,
                                   a.stride(0), *ops[3:], c.stride(0), stride_be, k, alpha, limit,
                                   A_BY_TOKEN=by_token, GATED=by_token, MUL_WEIGHTS=not by_token, HAS_BIAS=has_bias,
                                   ACTIVATION=form if by_token else SWIGLU, **common)
    return sum_top_k(out.view(tokens, k, hidden))


@triton.jit
def _sum_top_k_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (token * TOP_K + j).to(tl.int64) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_top_k(x: torch.Tensor) -> torch.Tensor:
    """[tokens, k, hidden] -> [tokens, hidden], summed in fp32: one light launch where torch's generic
    reduction took several microseconds a layer in batch-1 decode."""
    tokens, k, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_top_k_kernel[(tokens, triton.cdiv(hidden, block))](x, out, hidden, TOP_K=k, BLOCK=block, num_warps=4)
    return out
