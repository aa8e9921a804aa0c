"""Column- and row-parallel linear layers whose parameters load shard by shard.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies the slice this
rank owns; stacked layers (qkv, gate_up) take their parts one checkpoint tensor at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from pressroom.model.layers.quant import INT4_MAX_ROWS, NibbleMatrix, PackedInt4, Q4Weight, pack_rows
from pressroom.platforms.cpu import cpu_info


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}.")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.q4_parts: list[tuple[int, Q4Weight]] = []
        self.int4: NibbleMatrix | PackedInt4 | None = None
        self.onednn: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_int4(x):
            y = self.int4.matmul(x)
            return y + self.bias if self.bias is not None else y
        return self._dense(x, self.bias)

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def prepack_onednn(self) -> bool:
        """On the CPU: hold the weight in oneDNN's blocked layout, so no call re-lays it out (bf16: 27%
        faster at 32 rows; fp32 on an AVX2 EPYC: 10-30% faster than torch's BLAS, and the same bits for a
        row whatever the batch). The plain copy is dropped."""
        if not onednn_prepack(self.weight):
            return False
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 32)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True

    def _use_int4(self, x: torch.Tensor) -> bool:
        # The int4 kernel streams 4x fewer bytes but computes slower: it wins only for few rows.
        return self.int4 is not None and x.numel() <= INT4_MAX_ROWS * x.shape[-1]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._store_rows(param, 0, loaded)

    def _store_rows(self, param: nn.Parameter, row: int, loaded) -> None:
        """Copy `loaded` into rows [row, row + n) of param; 4-bit parts are also kept for packing."""
        if isinstance(loaded, Q4Weight):
            if param is not self.weight:
                raise ValueError("only weight matrices may come in 4 bits.")
            self.q4_parts.append((row, loaded))
            loaded = loaded.dequantize()
        _copy(param.data.narrow(0, row, loaded.shape[0]), loaded)

    def pack_int4(self) -> bool:
        """After loading: also keep the 4-bit form, if every row came in 4 bits (decode-sized batches use it)."""
        parts, self.q4_parts = self.q4_parts, []
        if not parts or self.weight.device.type != "cpu":
            return False
        self.int4 = pack_rows(parts, self.weight.shape[0])
        return self.int4 is not None


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


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matrix; KV heads replicate when ranks outnumber them."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        if shard_id == "q":
            heads = self.num_heads * self.tp_size
        else:
            heads = self.num_kv_heads * self.tp_size // self.kv_replicas
        _check_full(loaded, (heads * self.head_dim, *param.shape[1:]))
        self._store_rows(param, offset, loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        super().__init__(_divide(in_features, self.tp_size), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction.
        y = self.int4.matmul(x) if self._use_int4(x) else self._dense(x, None)
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded
            _copy(param.data, loaded)
            return
        size = param.shape[1]
        _check_full(loaded, (param.shape[0], size * self.tp_size))
        self._store_rows(param, 0, loaded.narrow(1, self.tp_rank * size, size))


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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)} where the model expects {tuple(dst.shape)}.")
    dst.copy_(src)
