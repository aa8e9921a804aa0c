"""MXFP4 weights quantized at load (`--quantization mxfp4`): weight-only, activations stay in their dtype.

Each linear layer loads dense (this rank's slice), then `process_weights_after_loading` quantizes it in blocks of
32 inputs (kernels/mxfp4.py): the layer then holds `weight` as packed E2M1 (uint8 [out, in / 2], the even input in
the low nibble) and `weight_scale` as E8M0 exponents (uint8 [out, in / 32]), 4.25 bits a weight. On CUDA it
multiplies through the Triton kernel that unpacks in registers (kernels/triton/quant_gemv.py: a GEMV for one
token, tl.dot tiles beyond); elsewhere through the reference, which dequantizes the weight to the activations'
dtype at each call (a correctness path: the CPU has no MXFP4 kernel).

Not yet: gpt-oss checkpoints (`*_blocks` / `*_scales`: the same packing), MoE experts. NVFP4 is nvfp4.py.
"""
from __future__ import annotations

import torch
from torch import nn

from pressroom.kernels import mxfp4 as kernels
from pressroom.model.quantization.base import LinearMethod, QuantizationMethod


class Mxfp4Method(QuantizationMethod):
    name = "mxfp4"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        if checkpoint_config is not None:
            raise ValueError("MXFP4 checkpoints (gpt-oss's *_blocks / *_scales) are not loaded yet; "
                             "--quantization mxfp4 quantizes a checkpoint of plain weights at load.")
        super().__init__(checkpoint_config)

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        kernels.check_shape(layer.weight.shape[1])  # before anything is read: a clear error, not a late one
        return Mxfp4LinearMethod()


class Mxfp4LinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        layer.register_buffer("weight_scale", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed, scales = kernels.quantize(layer.weight.data)
        layer.weight.data, layer.weight_scale = packed, scales

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:
            from pressroom.kernels.triton.quant_gemv import mxfp4_linear
            y = mxfp4_linear(flat, layer.weight, layer.weight_scale, bias)
        else:
            y = kernels.reference(flat, layer.weight, layer.weight_scale, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer multiplies by, in fp32 (for tests and inspection)."""
        return kernels.dequantize(layer.weight.data, layer.weight_scale)
