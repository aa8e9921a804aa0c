"""FP8 e4m3 weights: quantized at load (`--quantization fp8`) or as an FP8 checkpoint ships them.

Online: each linear layer loads dense (this rank's slice), then `process_weights_after_loading` quantizes it
with one scale per output channel; activations are quantized per token at each call. A checkpoint with
`quantization_config.quant_method == "fp8"` ships `X.weight` in FP8 beside `X.weight_scale` (one scale per
tensor, or per output channel: [out] or [out, 1]) or `X.weight_scale_inv` (DeepSeek's 128x128 blocks:
[ceil(out / 128), ceil(in / 128)], a multiplier despite its name). `checkpoint_weights` pairs each weight
with its scale into one lazy tensor, so a tensor-parallel rank reads only its rows or columns and the scales
that go with them.

A layer holds `weight` (FP8 [out, in]) and `weight_scale` (fp32 [out, groups]): each row's scale per group
of `group` inputs, the one form all three layouts take (a per-tensor scale repeated down the rows; a block's
scale repeated over its 128 rows), so stacked parts (q, k, v) with scales of their own, and row slices that
cut a block, need nothing special. On CUDA, steps of at most 16 tokens (decode) go through the weight-only Triton
GEMV (kernels/triton/quant_gemv.py: FP8 read, dequantized in registers, bf16 activations as they are); larger
per-channel steps through torch._scaled_mm on FP8 GPUs; larger steps over 128-input blocks (DeepSeek's) through the
block-scaled FP8 GEMM on FP8 GPUs (kernels/triton/fp8_block_gemm.py: activations quantized per token and 128 inputs);
anything else, and every weight on the CPU, through the dequantizing reference (kernels/fp8.py). The CPU keeps the
weight in FP8 and dequantizes it at each call rather than holding a bf16 copy: a DeepSeek-V3 is ~700 GB in FP8 and
twice that in bf16, so memory, not the per-call dequantization, decides what a host can serve.
DeepSeek's form (`fmt: "e4m3"`, `weight_block_size: [128, 128]`, `activation_scheme: "dynamic"`) may add
`scale_fmt: "ue8m0"`: its block scales are powers of two, stored as float32 or as exponent bytes (uint8 or
float8_e8m0fnu: 2^(byte - 127)), and activations are scaled by powers of two as well (kernels/fp8.py). Another
`fmt` or `scale_fmt`, or a scale that is not what `scale_fmt` says, is refused with a ValueError naming it.
Static activation scales (`input_scale`) are not used: where activations are quantized, they are scaled per
token (per token and 128-input group against block weights, DeepSeek's recipe).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pressroom.kernels import fp8 as kernels
from pressroom.kernels.fp8 import FP8
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import LinearMethod, QuantizationMethod, excluded, lazy_quantized, loads_into

_SCALES = (".weight_scale_inv", ".weight_scale")
_DROPPED = (".input_scale",)  # static activation scales: activations are scaled per token instead


@dataclass(slots=True)
class Fp8Weight:
    """Rows of an FP8 checkpoint weight with their scales in the per-row group form."""
    q: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # float32 [rows, ceil(cols / group)]
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return kernels.dequantize(self.q, self.scale, self.group)

    def take_rows(self, order: torch.Tensor) -> Fp8Weight:
        """Rows `order` (a permutation or selection): exact, since every row carries its own scales."""
        return Fp8Weight(self.q[order], self.scale[order], self.group)

    def part(self, index) -> Fp8Weight:
        """Rows [r0, r1) and columns [c0, c1) (a LazyWeight's index); columns split only at group edges."""
        (r0, r1), (c0, c1) = index
        if c0 % self.group or (c1 % self.group and c1 != self.q.shape[1]):
            raise ValueError(f"an FP8 weight in groups of {self.group} inputs cannot be split at columns [{c0}, {c1}).")
        return Fp8Weight(self.q[r0:r1, c0:c1], self.scale[r0:r1, c0 // self.group: -(-c1 // self.group)], self.group)

    def lazy(self) -> LazyWeight:
        """This in-memory weight as a lazy tensor again, for the layers' loaders (which narrow what they read)."""
        return LazyWeight(tuple(self.q.shape), FP8, self.part)


# quantization_config's fmt and scale_fmt values read here (None: not given)
FORMATS = (None, "e4m3")
SCALE_FORMATS = (None, "ue8m0")


class Fp8Method(QuantizationMethod):
    name = "fp8"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        config = checkpoint_config or {}
        self.block: tuple[int, int] | None = _block_size(config.get("weight_block_size"))
        if config.get("fmt") not in FORMATS:
            raise ValueError(f"quantization_config.fmt is {config['fmt']!r}; FP8 checkpoints are read in e4m3 only.")
        if config.get("scale_fmt") not in SCALE_FORMATS:
            raise ValueError(f"quantization_config.scale_fmt is {config['scale_fmt']!r}, an unknown scale format; "
                             "FP8 checkpoints are read with float32 scales (no scale_fmt) or ue8m0.")
        self.ue8m0 = config.get("scale_fmt") == "ue8m0"
        # HF's and vLLM's names for the modules a checkpoint left unquantized
        self.kept_dense = [*(config.get("modules_to_not_convert") or ()), *(config.get("ignored_layers") or ())]

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.serialized and excluded(prefix, self.kept_dense):
            return None
        return Fp8LinearMethod(self.serialized, self.block[1] if self.block else None, self.ue8m0)

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, LazyWeight]) -> Iterable[tuple[str, Any]]:
        tensor = tensors[name]
        if name.endswith(_SCALES + _DROPPED):
            return ()
        if tensor.dtype != FP8:
            return ((name, tensor),)
        keep = loads_into(model, name, Fp8LinearMethod)
        scale_name = _scale_of(tensors, name)
        return ((name, self._paired(tensor, tensors[scale_name], keep, scale_name)),)

    def _paired(self, weight: LazyWeight, scale: LazyWeight, keep: bool, scale_name: str) -> LazyWeight:
        """The weight and its scale (`scale_name`) as one lazy tensor: an Fp8Weight of the rows and columns read
        (kept by an FP8 layer), or those rows dequantized to fp32 (for any other parameter, or --quantization
        none)."""
        rows, cols = weight.shape
        scales = _ScaleLayout.of(_scale_values(scale.load(), self.ue8m0, scale_name), rows, cols, self.block,
                                 scale_name)

        def read(index) -> Fp8Weight:
            (r0, r1), (c0, c1) = index
            return Fp8Weight(weight.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0).load(), *scales.rows(r0, r1, c0, c1))

        return lazy_quantized((rows, cols), FP8, read, keep)


def _weight_only_fits(x: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    """Small steps (decode) read the FP8 weight through the weight-only Triton GEMV: activations stay in their
    dtype. Larger ones quantize activations per token for _scaled_mm's FP8 tensor cores."""
    from pressroom.kernels.triton.quant_gemv import SMALL_M, fp8_block_k
    return x.shape[0] <= SMALL_M and fp8_block_k(group, scale.shape[1], 16) is not None


def _block_size(block: Any) -> tuple[int, int] | None:
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, columns] of positive integers; "
                         f"got {block!r}.")
    return tuple(block)


_EXPONENT_BYTES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))


def _scale_values(scale: torch.Tensor, ue8m0: bool, name: str) -> torch.Tensor:
    """A checkpoint's scale tensor `name` as fp32 multipliers: floats as they are, ue8m0 exponent bytes as
    2^(byte - 127); under scale_fmt ue8m0 every scale must be a power of two."""
    if scale.dtype in _EXPONENT_BYTES:
        if not ue8m0:
            raise ValueError(f"{name} is stored as {scale.dtype} exponent bytes, but quantization_config has no "
                             "scale_fmt 'ue8m0' to say so.")
        exponents = scale.view(torch.uint8)
        if (exponents == 255).any():  # e8m0's NaN
            raise ValueError(f"{name} holds the ue8m0 NaN (byte 255).")
        return torch.exp2(exponents.float() - 127)
    values = scale.float()
    if ue8m0 and not ((values > 0) & (torch.frexp(values).mantissa == 0.5)).all():
        raise ValueError(f"{name} has scales that are not powers of two, which quantization_config's scale_fmt "
                         "'ue8m0' promises.")
    return values


def _block_gemm_fits(x: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    """Block scales in 128-input groups, on a GPU with FP8 tensor cores (compute capability 8.9 and later)."""
    from pressroom.kernels.triton.fp8_block_gemm import supported
    return supported(scale, group) and torch.cuda.get_device_capability(x.device) >= (8, 9)


def _scale_of(tensors: dict[str, LazyWeight], name: str) -> str:
    base = name.removesuffix(".weight")
    for suffix in _SCALES:
        if base + suffix in tensors:
            return base + suffix
    raise ValueError(f"{name} is stored in FP8 but the checkpoint has no {base}.weight_scale or "
                     f"{base}.weight_scale_inv to scale it.")


@dataclass(slots=True)
class _ScaleLayout:
    """One checkpoint scale tensor, read in the per-row group form for any rows and columns of its weight."""
    scale: torch.Tensor  # float32: [rows, 1] (per tensor or per channel) or [row blocks, column blocks]
    block: tuple[int, int] | None  # None: one group per row

    @classmethod
    def of(cls, scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None, name: str) -> _ScaleLayout:
        scale = scale.float()
        if scale.numel() == 1:
            return cls(scale.reshape(1, 1).expand(rows, 1), None)
        if scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
            return cls(scale.reshape(rows, 1), None)
        if block is not None and tuple(scale.shape) == (-(-rows // block[0]), -(-cols // block[1])):
            return cls(scale, block)
        expected = "[1], [out], [out, 1]" + (f" or [{-(-rows // block[0])}, {-(-cols // block[1])}]" if block else "")
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; for its FP8 weight of shape {(rows, cols)} "
                         f"takes {expected} (block scales need quantization_config.weight_block_size).")

    def rows(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, int]:
        """Scales [r1 - r0, groups] and the group width for weight rows [r0, r1) and columns [c0, c1)."""
        if self.block is None:
            return self.scale[r0:r1].contiguous(), c1 - c0
        block_rows, block_cols = self.block
        if c0 % block_cols:
            raise ValueError(f"an FP8 weight in {block_cols}-column blocks can only be split along its inputs at "
                             f"multiples of {block_cols} (here at {c0}); use a tensor_parallel_size that keeps "
                             "each rank's share of the inputs whole blocks.")
        per_row = self.scale[torch.arange(r0, r1) // block_rows]
        return per_row[:, c0 // block_cols: -(-c1 // block_cols)].contiguous(), block_cols


class Fp8LinearMethod(LinearMethod):
    """`serialized`: rows come in FP8 from the checkpoint; else the dense weight is quantized after loading.
    `block_cols`: the checkpoint's block width (its scales' group), None for one scale per row. `pow2_scales`:
    activations are scaled by powers of two (scale_fmt ue8m0)."""

    def __init__(self, serialized: bool, block_cols: int | None = None, pow2_scales: bool = False) -> None:
        self.serialized, self.block_cols, self.pow2_scales = serialized, block_cols, pow2_scales

    def create_weights(self, layer: nn.Module) -> None:
        out, cols = layer.weight.shape
        layer.register_buffer("weight_scale", None)
        layer.weight_group = self.block_cols or cols
        if self.serialized:
            device = layer.weight.device
            layer.weight.data = torch.empty(out, cols, dtype=FP8, device=device)
            layer.weight_scale = torch.ones(out, -(-cols // layer.weight_group), device=device)

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        if not self.serialized:
            return False
        if not isinstance(loaded, Fp8Weight):  # a part the checkpoint left unquantized: one scale per row
            loaded = Fp8Weight(*kernels.quantize(loaded, loaded.shape[1]), loaded.shape[1])
        rows, groups = loaded.q.shape[0], layer.weight_scale.shape[1]
        if loaded.scale.shape[1] == 1:  # one scale per row serves every group of the row
            scale = loaded.scale.expand(rows, groups)
        elif loaded.group == layer.weight_group:
            scale = loaded.scale
        else:
            raise ValueError(f"FP8 scales in groups of {loaded.group} inputs cannot join a layer scaled in groups "
                             f"of {layer.weight_group}.")
        if tuple(loaded.q.shape) != (rows, layer.weight.shape[1]) or row + rows > layer.weight.shape[0]:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.q.shape)}, which does not fit rows "
                             f"[{row}, {row + rows}) of a weight of shape {tuple(layer.weight.shape)}.")
        layer.weight.data[row:row + rows].copy_(loaded.q)
        layer.weight_scale[row:row + rows].copy_(scale)
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            q, scale = kernels.quantize(layer.weight.data, layer.weight_group)
            layer.weight.data, layer.weight_scale = q.contiguous(), scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w, scale = layer.weight, layer.weight_scale
        if flat.is_cuda and _weight_only_fits(flat, scale, layer.weight_group):
            from pressroom.kernels.triton.quant_gemv import fp8_linear
            y = fp8_linear(flat, w, scale, layer.weight_group, bias)
        elif scale.shape[1] == 1 and flat.is_cuda and kernels.scaled_mm_supported(flat, w):
            y = kernels.scaled_mm(flat, w, scale, bias)
        elif flat.is_cuda and _block_gemm_fits(flat, scale, layer.weight_group):
            from pressroom.kernels.triton.fp8_block_gemm import block_fp8_linear
            y = block_fp8_linear(flat, w, scale, bias, self.pow2_scales)
        else:
            y = kernels.reference(flat, w, scale, layer.weight_group, bias, self.pow2_scales)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer multiplies by, in fp32 (for tests and inspection)."""
        return kernels.dequantize(layer.weight.data, layer.weight_scale, layer.weight_group)
