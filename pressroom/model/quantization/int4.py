"""GPTQ and AWQ int4 checkpoints (`quant_method: "gptq"` / `"awq"`): weight-only, 4 bits a weight in memory.

GPTQ (AutoGPTQ / GPTQModel, `bits: 4`): `X.qweight` int32 [K / 8, N] packed along the inputs, `X.qzeros` int32
[G, N / 8] (v1 stores zero - 1; GPTQModel's `checkpoint_format: "gptq_v2"` the zero itself), `X.scales` fp16
[G, N], `X.g_idx` int32 [K] (with `desc_act`, the group of each input; without it, k // group_size, which is
dropped as such). AWQ (AutoAWQ GEMM, `version: "gemm"`): `X.qweight` int32 [K, N / 8] and `X.qzeros` [G, N / 8]
packed along the outputs in AWQ's interleaved order, `X.scales` fp16 [G, N]; it is repacked at load into GPTQ's
form (kernels/int4.py), the one form a layer holds, so one kernel serves both.

`checkpoint_weights` turns each X.qweight (with its zeros, scales and g_idx) into one lazy `X.weight` of the dense
shape [N, K]; q/k/v and gate/up parts land in their output columns of the stacked layer (act-order parts share
one g_idx: GPTQ orders a layer's inputs by its input's Hessian, which q, k and v share; a mismatch is an error).
On CUDA, steps of at most SMALL_M tokens go through the Triton weight-only kernel (kernels/triton/quant_gemv.py
`int4_linear`: nibbles unpacked in registers); larger steps dequantize to the activations' dtype for cuBLAS. On
the CPU the reference dequantizes at each call and multiplies (correctness, not speed); nothing is cached.

Tensor parallelism is refused: a rank's share of the inputs would cut packed words and act-order groups.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pressroom.kernels import int4 as kernels
from pressroom.kernels.int4 import AWQ_ORDER, PLAIN_ORDER, Int4Weight
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import LinearMethod, QuantizationMethod, lazy_quantized, loads_into

_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


class _Int4Method(QuantizationMethod):
    """What GPTQ and AWQ share; subclasses read their config and unpack their layout (`_read`)."""

    group_size: int

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        if checkpoint_config is None:  # nothing to quantize with at load: the checkpoint ships the int4 weights
            raise ValueError(f"--quantization {self.name} reads {self.name.upper()} checkpoints; this checkpoint has "
                             f"no quantization_config with quant_method {self.name!r}.")
        super().__init__(checkpoint_config)

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        from pressroom.distributed.parallel_state import get_tp_size
        if get_tp_size() > 1:
            raise ValueError(f"{self.name.upper()} checkpoints load with tensor_parallel_size 1 only: a rank's slice "
                             "of packed int4 words and their groups is not split yet.")
        out, k = layer.weight.shape
        if k % 8 or out % 8:
            raise ValueError(f"{prefix}: a {self.name.upper()} layer needs inputs and outputs in multiples of 8 "
                             f"(packed int4 words); it has {k} inputs and {out} outputs.")
        return Int4LinearMethod(self._group_size(k))

    def _group_size(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size  # -1: one group over all inputs

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, LazyWeight]) -> Iterable[tuple[str, Any]]:
        if not name.endswith(".qweight"):
            return () if name.endswith(_PARTS) else ((name, tensors[name]),)
        base = name.removesuffix(".qweight")
        return ((base + ".weight", self._paired(tensors, base, keep=loads_into(model, base + ".weight",
                                                                                 Int4LinearMethod))),)

    def _paired(self, tensors: dict[str, LazyWeight], base: str, keep: bool) -> LazyWeight:
        """X's packed tensors as one lazy weight of the dense shape: an Int4Weight of the output channels read (kept
        by an int4 layer) or those channels dequantized to fp32 (any other parameter, or --quantization none)."""
        out, k = self._dense_shape(tensors[base + ".qweight"].shape)

        def read(index) -> Int4Weight:
            (r0, r1), (c0, c1) = index
            if (c0, c1) != (0, k):
                raise ValueError(f"{base}: a slice of a {self.name.upper()} weight's inputs cannot be read "
                                 "(tensor parallelism is not supported for int4 checkpoints).")
            return self._read(tensors, base, out, k).columns(r0, r1)

        return lazy_quantized((out, k), torch.int32, read, keep)

    def _dense_shape(self, qweight_shape) -> tuple[int, int]:
        raise NotImplementedError

    def _read(self, tensors: dict[str, LazyWeight], base: str, out: int, k: int) -> Int4Weight:
        raise NotImplementedError


def _require_4_bits(config: dict, key: str, name: str) -> None:
    if config.get(key, 4) != 4:
        raise ValueError(f"{name} checkpoints are read in 4 bits only; this one has {key}={config[key]}.")


def _zeros_and_scales(tensors, base: str, order: tuple[int, ...], zero_offset: int) -> tuple[torch.Tensor, ...]:
    zeros = kernels.unpack_outputs(tensors[base + ".qzeros"].load(), order) + zero_offset
    return zeros.to(torch.uint8), tensors[base + ".scales"].load().to(torch.float16)


class GptqMethod(_Int4Method):
    name = "gptq"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        config = checkpoint_config
        _require_4_bits(config, "bits", "GPTQ")
        self.group_size = int(config.get("group_size", 128))
        # v1 (AutoGPTQ) stores zero - 1 (so a zero of 0 reads back as 16, as every v1 reader has it); v2 the zero
        self.zero_offset = 0 if config.get("checkpoint_format") == "gptq_v2" else 1

    def _dense_shape(self, qweight_shape) -> tuple[int, int]:
        return qweight_shape[1], qweight_shape[0] * 8

    def _read(self, tensors, base: str, out: int, k: int) -> Int4Weight:
        zeros, scales = _zeros_and_scales(tensors, base, PLAIN_ORDER, self.zero_offset)
        group = self._group_size(k)
        g_idx = tensors[base + ".g_idx"].load().to(torch.int32) if base + ".g_idx" in tensors else None
        if g_idx is not None and torch.equal(g_idx.long(), kernels.groups_of_inputs(k, None, group)):
            g_idx = None  # no act-order: the plain grouping, which the kernel reads without a gather
        return Int4Weight(tensors[base + ".qweight"].load(), scales, zeros, g_idx, group)


class AwqMethod(_Int4Method):
    name = "awq"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        config = checkpoint_config
        _require_4_bits(config, "bits" if "bits" in config else "w_bit", "AWQ")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ checkpoints are read in AutoAWQ's GEMM layout only; this one is {version!r}.")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        self.zero_point = bool(config.get("zero_point", True))

    def _dense_shape(self, qweight_shape) -> tuple[int, int]:
        return qweight_shape[1] * 8, qweight_shape[0]

    def _read(self, tensors, base: str, out: int, k: int) -> Int4Weight:
        q = kernels.unpack_outputs(tensors[base + ".qweight"].load(), AWQ_ORDER)  # [K, N]
        if self.zero_point:
            zeros, scales = _zeros_and_scales(tensors, base, AWQ_ORDER, 0)
        else:  # symmetric AWQ: values are centred on 8
            scales = tensors[base + ".scales"].load().to(torch.float16)
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
        return Int4Weight(kernels.pack_inputs(q), scales, zeros, None, self._group_size(k))


class Int4LinearMethod(LinearMethod):
    """A linear layer holding kernels/int4.py's form: buffers `qweight`, `scales`, `zeros`, `g_idx` (None without
    act-order); `weight` is a placeholder of the dense shape while loading (the loaders check shapes against it),
    then the packed words."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module) -> None:
        out, k = layer.weight.shape
        device, groups = layer.weight.device, -(-k // self.group_size)
        layer.register_buffer("qweight", torch.zeros(k // 8, out, dtype=torch.int32, device=device))
        layer.register_buffer("scales", torch.zeros(groups, out, dtype=torch.float16, device=device))
        layer.register_buffer("zeros", torch.zeros(groups, out, dtype=torch.uint8, device=device))
        layer.register_buffer("g_idx", None)
        layer.weight.data = torch.empty(1, 1, dtype=torch.int32, device=device).expand(out, k)  # no dense copy

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        if not isinstance(loaded, Int4Weight):
            raise ValueError("a layer of an int4 checkpoint got a part that is not quantized; mixed layers are not "
                             "supported.")
        n = loaded.shape[0]
        if loaded.shape[1] != layer.qweight.shape[0] * 8 or row + n > layer.qweight.shape[1] \
                or loaded.scales.shape[0] != layer.scales.shape[0]:
            raise ValueError(f"an int4 part of shape {tuple(loaded.shape)} with {loaded.scales.shape[0]} groups does "
                             f"not fit rows [{row}, {row + n}) of a layer of {layer.qweight.shape[1]} outputs, "
                             f"{layer.qweight.shape[0] * 8} inputs and {layer.scales.shape[0]} groups.")
        self._store_g_idx(layer, loaded.g_idx)
        layer.qweight[:, row:row + n].copy_(loaded.qweight)
        layer.scales[:, row:row + n].copy_(loaded.scales)
        layer.zeros[:, row:row + n].copy_(loaded.zeros)
        return True

    def _store_g_idx(self, layer: nn.Module, g_idx: torch.Tensor | None) -> None:
        """Parts of one layer share their inputs' grouping (one g_idx per layer)."""
        first = not hasattr(layer, "_g_idx_seen")
        if first:
            layer._g_idx_seen = True
            layer.g_idx = None if g_idx is None else g_idx.to(layer.qweight.device)
        elif (layer.g_idx is None) != (g_idx is None) or g_idx is not None and not torch.equal(layer.g_idx.cpu(),
                                                                                               g_idx.cpu()):
            raise ValueError("the stacked parts of an act-order GPTQ layer (q/k/v or gate/up) have different g_idx; "
                             "they must share their inputs' order.")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data = layer.qweight  # the packed words are the weight now; nothing dense is kept
        if hasattr(layer, "_g_idx_seen"):
            del layer._g_idx_seen

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.group_size)
        if flat.is_cuda:
            from pressroom.kernels.triton.quant_gemv import int4_linear
            y = int4_linear(flat, *args, bias)
        else:
            y = kernels.reference(flat, *args, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer multiplies by, in fp32 [N, K] (for tests and inspection)."""
        return kernels.dequantize(layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.group_size)
