"""LoRA updates applied by each token's adapter slot: out[t] += B_k (A_k x[t]) with k the token's slot, reading only
the slots the step's tokens use. Slot -1 (the base model, padding) adds nothing. Two designs, by the step's tokens
(lora/layers.py picks):

- `add_lora_fused` (Punica's BGMV, for decodes): ONE launch an adapted module. A program is (a token, a run of
  output features of one slice); it computes its token's shrink s = A x itself, then its features of B s, added in
  place. Every program of a token repeats the shrink (its A from L2 after the first): a program covers many features.
- `add_lora_grouped` (Punica's SGMV, for larger steps): tokens grouped by slot on the device (`group_by_slot`, once a
  step), then a shrink and an expand whose programs each take up to BLOCK_M tokens of ONE slot: the arithmetic is one
  adapter's per token, on the tensor cores.

Everything is graph-safe: grids depend only on the step's (padded) token count and the layer's shape, and the
grouping is computed on the device into tensors of fixed size.

Layout (lora/layers.py's LoRASlots): a [slots * W, in], b [out, slots * W] with W = slices * R (R the largest rank,
a smaller adapter's rows and columns zero); slot k's slice j at rows of a / columns of b k W + j R + [0, R), updating
output features [offset_j, offset_j + size_j) (`slice_table`); the adapter's scaling folded into b.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pressroom.kernels.triton import interpreting

_INTERPRETED = interpreting()  # the same test triton.jit made when the kernels below were defined
# The fused kernel's tiles of A and B: 32 KB (16K bf16 elements, 64 a thread over 8 warps), and its shrink loop
# pipelined 3 deep (loads without a dot are pipelined only when the loop asks): ~96 KB in flight per SM, to hide the
# load latency that made the old two-kernel decode path (64-wide tiles in a serial loop) slow.
_TILE_BYTES = 32768
_FUSED_WARPS = 8
_SHRINK_STAGES = 3

# Grouped products: BLOCK_M tokens of one slot a program (16 decodes of one slot fill half a tile; prefill chunks fill
# them), 64-wide steps of the input features, 128-wide steps of the output features; B's and A's tiles at most 8K
# elements (at rank 256 too: a pipelined stage's shared memory stays ~20 KB), so the width is cut into tiles of 128.
BLOCK_M = 32
_GROUPED_BLOCK_K = 64
_GROUPED_BLOCK_N = 128
_GROUPED_MAX_W = 128
_GROUPED_TILE_ELEMENTS = 8192
_GROUPED_FEATURES = 512  # an expand program's output features: it sums the shrink's partials once for all of them
_MAX_SPLITS = 4  # the shrink's split of the input features at few tiles (the expand sums the partials)


def _features_per_program(in_features: int, largest_slice: int) -> int:
    """Output features one fused program updates: half the input features (at least 1,024, at most a slice). Each
    program re-reads its slot's A (R x in: 128 KB at rank 16 on a 4,096-wide input) for its shrink; covering in / 2
    features, its read of B (features x R) is half that, so over a layer the repeated shrinks read about twice what
    the expand reads of B: on the 8B shape 14 programs a token for gate_up (1.8 MB from L2), not the 112 of
    256-wide tiles (14 MB), and at batch 1 a program's time stays its read of A."""
    return min(max(1024, triton.next_power_of_2(in_features) // 2), triton.next_power_of_2(largest_slice))


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    # FP32: fp32 products for fp32 weights (no TF32, as torch's matmul by default), and under Triton 3.6's interpreter,
    # which multiplies bf16 operands as raw 16-bit integers (fp32 copies of bf16 values give the same products).
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, slots_ptr, slice_ptr, out_ptr, stride_x, stride_a, stride_b, stride_o,
                  in_features, rank, width, tiles_per_slice,
                  FEATURES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  STAGES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) // tiles_per_slice
    first = (tl.program_id(1) % tiles_per_slice) * FEATURES
    slot = tl.load(slots_ptr + t)
    offset = tl.load(slice_ptr + 2 * j)
    size = tl.load(slice_ptr + 2 * j + 1)
    if (slot >= 0) & (first < size):
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        column = slot * width + j * rank + r  # the slice's rows of a, columns of b
        a_rows = a_ptr + column.to(tl.int64)[:, None] * stride_a
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)  # summed across threads once, after the loop
        for k in tl.range(0, in_features, BLOCK_K, num_stages=STAGES):
            cols = k + tl.arange(0, BLOCK_K)
            k_mask = cols < in_features
            xk = tl.load(x_ptr + t * stride_x + cols, mask=k_mask, other=0.0).to(tl.float32)
            ak = tl.load(a_rows + cols[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += ak.to(tl.float32) * xk[None, :]
        s = tl.sum(acc, axis=1)
        for sub in range(0, FEATURES, BLOCK_N):
            n = first + sub + tl.arange(0, BLOCK_N)
            n_mask = n < size
            n_out = (offset + n).to(tl.int64)
            b = tl.load(b_ptr + n_out[:, None] * stride_b + column[None, :], mask=n_mask[:, None] & r_mask[None, :],
                        other=0.0)
            delta = tl.sum(b.to(tl.float32) * s[None, :], axis=1)
            o = tl.load(out_ptr + t * stride_o + n_out, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * stride_o + n_out, (o + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def _check(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if out.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("LoRA kernels need unit column strides for out, a and b.")
    return x if x.stride(-1) == 1 else x.contiguous()


def add_lora_fused(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                   slice_table: torch.Tensor, largest_slice: int, rank: int) -> None:
    """out [T, out_features] += each token's slot's B (A x) in place, one launch; x [T, in_features]; token_slots [T]
    (-1: none); slice_table [slices, 2] int32 on the device: (first output feature, features) of each slice;
    largest_slice: the most features of one slice; rank: R, the rows of a slice in a slot."""
    tokens, in_features = x.shape
    if tokens == 0:
        return
    x = _check(out, x, a, b)
    block_r = max(16, triton.next_power_of_2(rank))
    features = _features_per_program(in_features, largest_slice)
    tiles = triton.cdiv(largest_slice, features)
    tile = _TILE_BYTES // a.element_size()
    block_k = min(triton.next_power_of_2(in_features), max(64, tile // block_r))
    block_n = min(features, max(64, tile // block_r))
    _fused_kernel[(tokens, slice_table.shape[0] * tiles)](
        x, a, b, token_slots, slice_table, out, x.stride(0), a.stride(0), b.stride(0), out.stride(0),
        in_features, rank, slice_table.shape[0] * rank, tiles,
        FEATURES=features, BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_R=block_r, STAGES=_SHRINK_STAGES,
        num_warps=_FUSED_WARPS)


@dataclass(frozen=True)
class SlotGroups:
    """A step's tokens grouped by adapter slot, on the device, every tensor's size fixed by the step's token count
    and the slot count: slot k's tokens are order[starts[k]:starts[k + 1]] (in step order; the base model's last,
    in no group), cut into tiles of BLOCK_M numbered [tile_starts[k], tile_starts[k + 1])."""
    order: torch.Tensor  # [T] int32: token indices, sorted by slot
    starts: torch.Tensor  # [slots + 1] int32
    tile_starts: torch.Tensor  # [slots + 1] int32
    num_slots: int

    @property
    def max_tiles(self) -> int:
        """A bound on the tiles of any step of these tokens (a slot's last tile may be partial): the grids' size."""
        return self.order.shape[0] // BLOCK_M + self.num_slots


def group_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGroups:
    """A stable counting sort of the tokens by slot, in a few device ops with no host sync (graph-safe): each token's
    place is its slot's start plus the tokens of its slot before it."""
    device = token_slots.device
    key = token_slots.remainder(num_slots + 1)  # slot -1 (the base model) becomes num_slots: its tokens last
    one_hot = key[:, None] == torch.arange(num_slots + 1, device=device)
    before = one_hot.cumsum(0, dtype=torch.int32)  # [T, slots + 1]: tokens of each slot up to and including t
    counts = before[-1]
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    starts = torch.cat([zero, counts.cumsum(0, dtype=torch.int32)])
    place = starts[key] + before.gather(1, key[:, None]).squeeze(1) - 1
    order = torch.empty_like(place).scatter_(0, place.long(), torch.arange(len(key), dtype=torch.int32,
                                                                           device=device))
    tiles = (counts[:num_slots] + BLOCK_M - 1) // BLOCK_M
    tile_starts = torch.cat([zero, tiles.cumsum(0, dtype=torch.int32)])
    return SlotGroups(order, starts[:num_slots + 1].contiguous(), tile_starts, num_slots)


@triton.jit
def _tile_rows(order_ptr, starts_ptr, tile_starts_ptr, num_slots, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """This program's slot (num_slots: no tile, past the step's last), its rows in the sorted order and their
    tokens."""
    tile = tl.program_id(0)
    k = tl.arange(0, BLOCK_S)
    ends = tl.load(tile_starts_ptr + 1 + k, mask=k < num_slots, other=2147483647)
    slot = tl.sum((ends <= tile).to(tl.int32), axis=0)  # ends never decrease: the slot whose tiles hold this one
    safe = tl.minimum(slot, num_slots - 1)
    row0 = tl.load(starts_ptr + safe) + (tile - tl.load(tile_starts_ptr + safe)) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = (rows < tl.load(starts_ptr + safe + 1)) & (slot < num_slots)
    tokens = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return slot, rows, row_mask, tokens


@triton.jit
def _grouped_shrink_kernel(x_ptr, a_ptr, order_ptr, starts_ptr, tile_starts_ptr, s_ptr, stride_x, stride_a,
                           stride_split, stride_s, in_features, width, k_per_split, w_tiles, num_slots,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                           BLOCK_S: tl.constexpr, FP32: tl.constexpr):
    """s[split, row, a tile of the width] = x[token] . A_slot^T over this split's input features, for a tile of one
    slot's rows."""
    slot, rows, row_mask, tokens = _tile_rows(order_ptr, starts_ptr, tile_starts_ptr, num_slots, BLOCK_M, BLOCK_S)
    if slot < num_slots:
        split = tl.program_id(1) // w_tiles
        w = (tl.program_id(1) % w_tiles) * BLOCK_W + tl.arange(0, BLOCK_W)
        w_mask = w < width
        a_cols = a_ptr + (slot * width + w).to(tl.int64)[None, :] * stride_a  # A^T: [K, W]
        acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
        k_first = split * k_per_split
        for k in range(k_first, tl.minimum(k_first + k_per_split, in_features), BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            k_mask = cols < in_features
            xk = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & k_mask[None, :],
                         other=0.0)
            ak = tl.load(a_cols + cols[:, None], mask=k_mask[:, None] & w_mask[None, :], other=0.0)
            acc += _dot(xk.to(ak.dtype), ak, FP32)
        tl.store(s_ptr + split * stride_split + rows.to(tl.int64)[:, None] * stride_s + w[None, :], acc,
                 mask=row_mask[:, None] & w_mask[None, :])


@triton.jit
def _grouped_expand_kernel(s_ptr, b_ptr, order_ptr, starts_ptr, tile_starts_ptr, slice_ptr, out_ptr, stride_split,
                           stride_s, stride_b, stride_o, splits, rank, width, tiles_per_slice, num_slots,
                           FEATURES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, FP32: tl.constexpr):
    """out[token, a run of slice j's features] += s[row, slice j's columns] . B_slot^T, for a tile of one slot's rows
    (each token in one row: no two programs write one element)."""
    slot, rows, row_mask, tokens = _tile_rows(order_ptr, starts_ptr, tile_starts_ptr, num_slots, BLOCK_M, BLOCK_S)
    j = tl.program_id(1) // tiles_per_slice
    first = (tl.program_id(1) % tiles_per_slice) * FEATURES
    offset = tl.load(slice_ptr + 2 * j)
    size = tl.load(slice_ptr + 2 * j + 1)
    if (slot < num_slots) & (first < size):
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        s_tile = s_ptr + rows.to(tl.int64)[:, None] * stride_s + (j * rank + r)[None, :]
        s_mask = row_mask[:, None] & r_mask[None, :]
        s = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in range(0, splits):  # the shrink's partial sums, once for all this program's features
            s += tl.load(s_tile + split * stride_split, mask=s_mask, other=0.0)
        column = (slot * width + j * rank + r).to(tl.int64)
        for sub in range(0, FEATURES, BLOCK_N):
            n = first + sub + tl.arange(0, BLOCK_N)
            n_mask = n < size
            n_out = (offset + n).to(tl.int64)
            bt = tl.load(b_ptr + n_out[None, :] * stride_b + column[:, None], mask=r_mask[:, None] & n_mask[None, :],
                         other=0.0)  # B^T: [R, N]
            delta = _dot(s.to(bt.dtype), bt, FP32)
            o_ptrs = out_ptr + tokens[:, None] * stride_o + n_out[None, :]
            o_mask = row_mask[:, None] & n_mask[None, :]
            o = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, (o + delta).to(out_ptr.dtype.element_ty), mask=o_mask)


def _splits(max_tiles: int, in_features: int) -> int:
    """The shrink's split of the input features: up to 4 where a step has few tiles (a decode step of 256 tokens
    over 16 slots: 16 tiles, one program each would leave most SMs idle), none where tiles fill the GPU."""
    return max(1, min(_MAX_SPLITS, in_features // 1024, 128 // max_tiles))


def add_lora_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: SlotGroups,
                     slice_table: torch.Tensor, largest_slice: int, rank: int) -> None:
    """As `add_lora_fused`, for the tokens grouped by `group_by_slot` (the step's x rows): a shrink and an expand
    launch, each program on up to BLOCK_M tokens of one slot."""
    tokens, in_features = x.shape
    if tokens == 0:
        return
    x = _check(out, x, a, b)
    num_slices = slice_table.shape[0]
    width = num_slices * rank
    block_s = max(16, triton.next_power_of_2(groups.num_slots))
    tiles, splits = groups.max_tiles, _splits(groups.max_tiles, in_features)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), _GROUPED_BLOCK_K) * _GROUPED_BLOCK_K
    block_w = min(_GROUPED_MAX_W, max(16, triton.next_power_of_2(width)))
    w_tiles = triton.cdiv(width, block_w)
    block_r = max(16, triton.next_power_of_2(rank))
    s = torch.empty(splits, tokens, width, dtype=torch.float32, device=x.device)  # by sorted row
    fp32 = a.dtype == torch.float32 or _INTERPRETED
    meta = (groups.order, groups.starts, groups.tile_starts)
    _grouped_shrink_kernel[(tiles, splits * w_tiles)](
        x, a, *meta, s, x.stride(0), a.stride(0), s.stride(0), s.stride(1), in_features, width, k_per_split, w_tiles,
        groups.num_slots, BLOCK_M=BLOCK_M, BLOCK_K=_GROUPED_BLOCK_K, BLOCK_W=block_w, BLOCK_S=block_s, FP32=fp32,
        num_warps=4)
    feature_tiles = triton.cdiv(largest_slice, _GROUPED_FEATURES)
    _grouped_expand_kernel[(tiles, num_slices * feature_tiles)](
        s, b, *meta, slice_table, out, s.stride(0), s.stride(1), b.stride(0), out.stride(0), splits, rank, width,
        feature_tiles, groups.num_slots, FEATURES=_GROUPED_FEATURES, BLOCK_M=BLOCK_M,
        BLOCK_N=min(_GROUPED_BLOCK_N, max(32, _GROUPED_TILE_ELEMENTS // block_r)), BLOCK_R=block_r, BLOCK_S=block_s,
        FP32=fp32, num_warps=4)
