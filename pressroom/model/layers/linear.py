"""Column- and row-parallel linear layers whose parameters load shard by shard.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies the slice this
rank owns; stacked layers (qkv, gate_up) take their parts one checkpoint tensor at a time. `loaded` is
usually a LazyWeight: the loaders narrow it to this rank's slice first and materialize it last, so a rank
reads only its slice of the checkpoint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from pressroom.kernels import batch_invariant as invariant
from pressroom.model.layers.deferred import allocate_dense, held_weight, is_expanded
from pressroom.model.layers.quant import (
    INT4_MAX_ROWS,
    GgmlRows,
    GgmlStack,
    NibbleMatrix,
    PackedInt4,
    Q4Weight,
    pack_ggml,
    pack_rows,
)
from pressroom.model.lazy_weight import materialize
from pressroom.model.quantization.base import LinearMethod
from pressroom.platforms.cpu import cpu_info


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}.")
    return a // b


class LinearBase(nn.Module):
    batch_invariant = False  # set at load under --batch-invariant (model/batch_invariant.py)

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's (the weight may be repacked)
        self.weight = held_weight(out_features, in_features)  # a stand-in while the loader defers it
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.q4_parts: list[tuple[int, Q4Weight]] = []
        self.int4: NibbleMatrix | PackedInt4 | None = None
        self.ggml_parts: list[tuple[int, GgmlRows]] = []
        self.ggml: GgmlRows | GgmlStack | None = None  # in place of the dense weight (GGUF, layers/quant.py)
        self.onednn: torch.Tensor | None = None
        self.quant_method: LinearMethod | None = None  # a quantization method's: it holds and applies the weight

    def set_quant_method(self, method: LinearMethod) -> None:
        """Before loading: hand the weight to a quantization method (model/quantization/)."""
        self.quant_method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        if self.ggml is not None:
            y = self.ggml.matmul(x)
            return y + self.bias if self.bias is not None else y
        if self._use_int4(x):
            y = self.int4.matmul(x)
            return y + self.bias if self.bias is not None else y
        return self._dense(x, self.bias)

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.batch_invariant:
            return invariant.linear(x, self.weight, bias, self.onednn)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def prepack_onednn(self) -> bool:
        """On the CPU: hold the weight in oneDNN's blocked layout, so no call re-lays it out (bf16: 27%
        faster at 32 rows; fp32 on an AVX2 EPYC: 10-30% faster than torch's BLAS, and the same bits for a
        row whatever the batch). The plain copy is dropped. A quantization method's weight is its own."""
        if self.quant_method is not None or self.ggml is not None or not onednn_prepack(self.weight):
            return False
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 32)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True

    def _use_int4(self, x: torch.Tensor) -> bool:
        # The 4-bit row kernel streams 4x fewer bytes but computes slower: it wins only for few rows; a VNNI
        # panel (quant.py) takes steps of up to VNNI_MAX_ROWS; prefill chunks beyond take the dense weight.
        limit = self.int4.max_rows if isinstance(self.int4, NibbleMatrix) else INT4_MAX_ROWS
        return self.int4 is not None and x.numel() <= limit * x.shape[-1]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._store_rows(param, 0, loaded)

    def _store_rows(self, param: nn.Parameter, row: int, loaded) -> None:
        """Copy `loaded` (read now, if lazy) into rows [row, row + n) of param; 4-bit parts are also kept
        for packing."""
        loaded = materialize(loaded)
        if param is self.weight and self.quant_method is not None and self.quant_method.store_rows(self, row, loaded):
            return
        if isinstance(loaded, GgmlRows):  # kept as shipped; no dense copy unless some rows come otherwise
            if param is not self.weight:
                raise ValueError("only weight matrices may come quantized.")
            self.ggml_parts.append((row, loaded))
            return
        if isinstance(loaded, Q4Weight):
            if param is not self.weight:
                raise ValueError("only weight matrices may come in 4 bits.")
            self.q4_parts.append((row, loaded))
            loaded = loaded.dequantize()
        if param is self.weight:
            self._allocate_weight()
        _copy(param.data.narrow(0, row, loaded.shape[0]), loaded)

    def _allocate_weight(self) -> None:
        """The dense weight, where the loader left a stand-in until some rows come dense (a GGUF's projections:
        layers/deferred.py); a quantization method's weight is its own."""
        if self.quant_method is None and is_expanded(self.weight):
            allocate_dense(self.weight)

    def pack_int4(self) -> bool:
        """After loading: also keep the 4-bit form, if every row came in 4 bits (decode-sized batches use it);
        a matrix whose rows all came in GGML forms holds them instead of its dense weight."""
        if self.ggml_parts:
            return self._pack_ggml()
        self._allocate_weight()  # rows that came dense or in Q4 allocated it already; this is for none at all
        parts, self.q4_parts = self.q4_parts, []
        if not parts or self.weight.device.type != "cpu":
            return False
        self.int4 = pack_rows(parts, self.weight.shape[0])
        return self.int4 is not None


    def _pack_ggml(self) -> bool:
        parts, self.ggml_parts = self.ggml_parts, []
        self.ggml = pack_ggml(parts, self.weight.shape[0])
        if self.ggml is None:  # some rows came dense: the quantized ones join them
            self._allocate_weight()
            for row, part in parts:
                _copy(self.weight.data.narrow(0, row, part.shape[0]), part.dequantize())
            return False
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward unless gathered."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        super().__init__(in_features, _divide(out_features, self.tp_size), bias)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return tp_all_gather(y) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _check_full(loaded, (size * self.tp_size, *param.shape[1:]))
        self._store_rows(param, 0, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one matrix (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = _divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(_divide(s, self.tp_size) for s in self.output_sizes[:shard_id])
        _check_full(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        self._store_rows(param, offset, loaded.narrow(0, self.tp_rank * size, size))


def head_split(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int, int, int]:
    """This rank's attention heads as (first query head, query heads, first KV head, KV heads).

    KV heads are dealt out whole, as evenly as they go (3 over 2 ranks: 2 and 1), each with its group of
    query heads, so a rank attends with nothing from another; with fewer KV heads than ranks each KV head
    is replicated on tp_size / num_kv_heads ranks, which split its query heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not share {num_kv_heads} KV heads evenly.")
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        kv_count, kv_start = base + (rank < extra), rank * base + min(rank, extra)
        group = num_heads // num_kv_heads
        return kv_start * group, kv_count * group, kv_start, kv_count
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} ranks.")
    q_count = _divide(num_heads, tp_size)
    return rank * q_count, q_count, rank // (tp_size // num_kv_heads), 1


class QKVParallelLinear(LinearBase):
    """Query, key and value projections in one matrix, this rank's heads only (`head_split`)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = head_split(
            num_heads, num_kv_heads, self.tp_size, self.tp_rank)
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        offset, size, start, heads = {
            "q": (0, q_size, self.q_start * d, self.total_heads),
            "k": (q_size, kv_size, self.kv_start * d, self.total_kv_heads),
            "v": (q_size + kv_size, kv_size, self.kv_start * d, self.total_kv_heads)}[shard_id]
        _check_full(loaded, (heads * d, *param.shape[1:]))
        self._store_rows(param, offset, loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced. `input_slice` (start, length): this
    rank's input features when they are not an even split (an attention output over uneven heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 input_slice: tuple[int, int] | None = None) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if input_slice is None:
            size = _divide(in_features, self.tp_size)
            input_slice = (self.tp_rank * size, size)
        self.in_total, self.in_start = in_features, input_slice[0]
        super().__init__(input_slice[1], out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction.
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, None)
        elif self.ggml is not None:
            y = self.ggml.matmul(x)
        else:
            y = self.int4.matmul(x) if self._use_int4(x) else self._dense(x, None)
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded
            _copy(param.data, loaded)
            return
        _check_full(loaded, (param.shape[0], self.in_total))
        self._store_rows(param, 0, loaded.narrow(1, self.in_start, param.shape[1]))


def onednn_prepack(weight: torch.Tensor) -> bool:
    """Whether a CPU weight goes to oneDNN's blocked layout: fp32 wherever torch has oneDNN; bf16 only
    where oneDNN has a bf16 matmul, AVX-512 CPUs (AVX-NE-CONVERT ones are left to F.linear): asked of
    the CPU's tier and of torch, not found out by a crash."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu_info().bf16_storage and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _check_full(loaded, expected: tuple[int, ...]) -> None:
    """The whole checkpoint tensor must match the config before this rank takes its slice."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)} where the model config implies "
                         f"{tuple(expected)}; the checkpoint and config.json disagree.")


def _copy(dst: torch.Tensor, src) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)} where the model expects {tuple(dst.shape)}.")
    dst.copy_(materialize(src))
