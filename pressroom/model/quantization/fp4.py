"""What MXFP4 and NVFP4 share: the layer methods for linear layers and experts, quantized at load ("online") or
filled from a checkpoint's packed rows, and checkpoint parts read lazily as `Fp4Weight`s.

Both formats pack E2M1 values two per byte, the even input in the low nibble (gpt-oss's `*_blocks`, ModelOpt's
NVFP4 `weight`), and scale blocks of inputs: MXFP4 by E8M0 exponents over 32 inputs, NVFP4 by FP8 e4m3 values over
16 inputs times an fp32 global scale. A layer holds:

- linear: `weight` packed uint8 [out, in / 2], `weight_scale` [out, in / block], NVFP4's `weight_global_scale`
  fp32 [out] (one per row, so stacked parts a checkpoint quantized apart keep theirs);
- experts (`FusedMoE`): `w13` / `w2` packed [experts, rows, cols / 2] with `w13_scale` / `w2_scale` and NVFP4's
  `w13_global_scale` / `w2_global_scale` [experts, rows] (kernels/fp4_moe.py's `Fp4Experts`).

Weight-only: activations stay in their dtype. On CUDA the Triton kernels unpack in registers (kernels/triton/
quant_gemv.py for linear layers, kernels/triton/fused_moe.py `fused_moe_fp4` for experts); elsewhere the torch
references dequantize at each call (correctness, not speed). A part a checkpoint ships dense into a layer that
holds FP4 (a layer its config does not exclude) is quantized as it loads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pressroom.kernels import fp4_moe, mxfp4, nvfp4
from pressroom.kernels.fp4_moe import Fp4Experts
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import LinearMethod, MoeMethod, QuantizationMethod, excluded, lazy_quantized

_BLOCK = {"mxfp4": mxfp4.BLOCK, "nvfp4": nvfp4.BLOCK}
_SCALE_DTYPE = {"mxfp4": torch.uint8, "nvfp4": nvfp4.FP8}


@dataclass(slots=True)
class Fp4Weight:
    """Rows of an FP4 weight as a checkpoint ships them (this rank's rows and columns), in the layer's form."""
    packed: torch.Tensor  # uint8 [rows, cols / 2]
    scales: torch.Tensor  # [rows, cols / block]
    global_scale: torch.Tensor | None  # NVFP4: fp32 [rows]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], 2 * self.packed.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.global_scale is None:
            return mxfp4.dequantize(self.packed, self.scales, dtype)
        return nvfp4.dequantize(self.packed, self.scales, self.global_scale, dtype)


def quantized(w: torch.Tensor, fmt: str) -> Fp4Weight:
    """A dense matrix [rows, cols] in `fmt`."""
    return Fp4Weight(*fp4_moe.quantize_rows(w, fmt))


def check_shape(fmt: str, cols: int) -> None:
    (mxfp4 if fmt == "mxfp4" else nvfp4).check_shape(cols)


def lazy_fp4(shape: tuple[int, int], block: int, read: Callable[[int, int, int, int], Fp4Weight], keep: bool,
             name: str) -> LazyWeight:
    """A checkpoint's FP4 weight as one lazy tensor of the dense shape [rows, cols]: `read(r0, r1, b0, b1)` reads
    rows [r0, r1) and scale blocks [b0, b1). Kept (an FP4 layer takes it) it stays an Fp4Weight; otherwise it is
    dequantized to fp32 (a dense parameter, or --quantization none)."""
    def read_index(index) -> Fp4Weight:
        (r0, r1), (c0, c1) = index
        if c0 % block or c1 % block:
            raise ValueError(f"{name}: an FP4 weight in blocks of {block} inputs can only be split along its inputs "
                             f"at multiples of {block} (here [{c0}, {c1})); use a tensor_parallel_size that keeps "
                             "each rank's share of the inputs whole blocks.")
        return read(r0, r1, c0 // block, c1 // block)

    return lazy_quantized(shape, torch.uint8, read_index, keep)


class Fp4LinearMethod(LinearMethod):
    """A linear layer's weight in `fmt`: quantized after loading (online), or filled row by row from a checkpoint
    (`serialized`)."""

    fmt: ClassVar[str] = ""

    def __init__(self, serialized: bool = False) -> None:
        self.serialized = serialized

    def create_weights(self, layer: nn.Module) -> None:
        out, cols = layer.weight.shape
        layer.register_buffer("weight_scale", None)
        layer.register_buffer("weight_global_scale", None)
        if self.serialized:  # no dense copy: the rows come packed
            device = layer.weight.device
            # the loaders narrow by the weight's shape: a placeholder of the dense shape until the rows are in
            layer.weight.data = torch.zeros(1, 1, dtype=torch.uint8, device=device).expand(out, cols)
            layer.weight_packed = torch.zeros(out, cols // 2, dtype=torch.uint8, device=device)
            layer.weight_scale = torch.zeros(out, cols // _BLOCK[self.fmt], dtype=_SCALE_DTYPE[self.fmt],
                                             device=device)
            if self.fmt == "nvfp4":
                layer.weight_global_scale = torch.zeros(out, device=device)

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        if not self.serialized:
            return False
        if not isinstance(loaded, Fp4Weight):  # a part the checkpoint ships dense
            loaded = quantized(loaded.to(layer.weight.device), self.fmt)
        n, cols = loaded.shape
        if cols != layer.weight.shape[1] or row + n > layer.weight.shape[0]:
            raise ValueError(f"an FP4 part of shape {tuple(loaded.shape)} does not fit rows [{row}, {row + n}) of a "
                             f"weight of shape {tuple(layer.weight.shape)}.")
        layer.weight_packed[row:row + n].copy_(loaded.packed)
        layer.weight_scale[row:row + n].copy_(loaded.scales)
        if loaded.global_scale is not None:
            layer.weight_global_scale[row:row + n].copy_(loaded.global_scale)
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.serialized:
            layer.weight.data = layer.weight_packed
            del layer.weight_packed
            return
        part = quantized(layer.weight.data, self.fmt)
        layer.weight.data, layer.weight_scale, layer.weight_global_scale = part.packed, part.scales, part.global_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, scale, global_scale = layer.weight, layer.weight_scale, layer.weight_global_scale
        if flat.is_cuda:
            from pressroom.kernels.triton import quant_gemv
            y = quant_gemv.mxfp4_linear(flat, w, scale, bias) if global_scale is None else \
                quant_gemv.nvfp4_linear(flat, w, scale, global_scale, bias)
        else:
            y = torch.nn.functional.linear(flat, self.dequantized(layer, flat.dtype), bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by (fp32 by default: for tests and inspection)."""
        return Fp4Weight(layer.weight.data, layer.weight_scale, layer.weight_global_scale).dequantize(dtype)


_EXPERT_PARAMS = ("w13", "w2")


class Fp4MoeMethod(MoeMethod):
    """A FusedMoE's experts in `fmt`: quantized after loading (online), or filled from a checkpoint (`serialized`)."""

    def __init__(self, fmt: str, serialized: bool = False) -> None:
        self.fmt, self.serialized = fmt, serialized

    def create_weights(self, layer: nn.Module) -> None:
        for param in _EXPERT_PARAMS:
            layer.register_buffer(f"{param}_scale", None)
            layer.register_buffer(f"{param}_global_scale", None)
            if not self.serialized:
                continue
            dense = getattr(layer, param)
            experts, rows, cols = dense.shape
            device = dense.device
            dense.data = torch.zeros(experts, rows, cols // 2, dtype=torch.uint8, device=device)
            setattr(layer, f"{param}_scale", torch.zeros(experts, rows, cols // _BLOCK[self.fmt],
                                                          dtype=_SCALE_DTYPE[self.fmt], device=device))
            if self.fmt == "nvfp4":
                setattr(layer, f"{param}_global_scale", torch.zeros(experts, rows, device=device))

    def store_rows(self, layer: nn.Module, param: str, expert: int, row: int, loaded: Any) -> bool:
        if not self.serialized:
            return False
        target = getattr(layer, param).data[expert]
        if not isinstance(loaded, Fp4Weight):
            loaded = quantized(loaded.to(target.device), self.fmt)
        n, cols = loaded.shape
        if cols != 2 * target.shape[1] or row + n > target.shape[0]:
            raise ValueError(f"an FP4 expert part of shape {tuple(loaded.shape)} does not fit rows [{row}, {row + n}) "
                             f"of a matrix of shape {(target.shape[0], 2 * target.shape[1])}.")
        target[row:row + n].copy_(loaded.packed)
        getattr(layer, f"{param}_scale")[expert, row:row + n].copy_(loaded.scales)
        if loaded.global_scale is not None:
            getattr(layer, f"{param}_global_scale")[expert, row:row + n].copy_(loaded.global_scale)
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.serialized:
            return
        for param in _EXPERT_PARAMS:
            experts = fp4_moe.quantize(getattr(layer, param).data, self.fmt)
            getattr(layer, param).data = experts.packed
            setattr(layer, f"{param}_scale", experts.scales)
            setattr(layer, f"{param}_global_scale", experts.global_scale)

    def experts(self, layer: nn.Module, param: str) -> Fp4Experts:
        """The layer's `param` ("w13" or "w2") as kernels/fp4_moe.py's stacked form."""
        return Fp4Experts(getattr(layer, param).data, getattr(layer, f"{param}_scale"),
                          getattr(layer, f"{param}_global_scale"))

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2, local = self.experts(layer, "w13"), self.experts(layer, "w2"), layer.local_ids(ids)
        options = dict(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, activation=layer.activation)  # gpt-oss's
        if x.is_cuda:
            from pressroom.kernels.triton.fused_moe import fused_moe_fp4
            return fused_moe_fp4(x.contiguous(), w13, w2, weights, local, all_local=layer.owns_all, **options)
        return fp4_moe.reference(x, w13, w2, weights, local, **options)


def check_experts(fmt: str, layer: nn.Module, prefix: str) -> None:
    """Experts are quantized along their inputs: hidden features, and this rank's intermediate features."""
    for cols in (layer.hidden, layer.intermediate):
        if cols % _BLOCK[fmt]:
            raise ValueError(f"{prefix}: {fmt.upper()} quantizes experts in blocks of {_BLOCK[fmt]} inputs; their "
                             f"{layer.hidden} hidden and {layer.intermediate} intermediate features (per rank) are "
                             "not whole blocks. Leave this model's --quantization at auto.")


class Fp4Method(QuantizationMethod):
    """What the MXFP4 and NVFP4 methods share: every linear layer and every layer's experts in FP4, except the
    modules a checkpoint keeps dense (`kept_dense`, set from its config by the subclass)."""

    linear_method: type[Fp4LinearMethod]

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        self.kept_dense: list[str] = []

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.serialized and excluded(prefix, self.kept_dense):
            return None
        check_shape(self.name, layer.weight.shape[1])  # before anything is read: a clear error, not a late one
        return self.linear_method(self.serialized)

    def moe_method(self, layer: nn.Module, prefix: str) -> MoeMethod | None:
        if not getattr(layer, "gated", True):  # relu² experts (Nemotron-H): FP4 kernels read a gate half
            return None
        if self.serialized and excluded(prefix, self.kept_dense):
            return None
        check_experts(self.name, layer, prefix)
        return Fp4MoeMethod(self.name, self.serialized)
