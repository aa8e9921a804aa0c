"""NVFP4 weights quantized at load (`--quantization nvfp4`): weight-only, activations stay in their dtype.

As mxfp4.py, with NVFP4's scales (kernels/nvfp4.py): after loading, the layer holds `weight` packed E2M1 (uint8
[out, in / 2]), `weight_scale` FP8 e4m3 [out, in / 16] and `weight_global_scale` fp32 [1] (one per rank's slice:
each rank quantizes what it loaded), 4.5 bits a weight. On CUDA the Triton kernel unpacks in registers
(kernels/triton/quant_gemv.py `nvfp4_linear`: the MXFP4 kernel with 8-byte blocks and an FP8 scale); elsewhere the
reference dequantizes at each call. The H200 has no FP4 tensor cores: this is for the bytes, as MXFP4 is.

Not yet: NVFP4 checkpoints (ModelOpt's `weight_scale` / `weight_scale_2` / `input_scale`), experts.
"""
from __future__ import annotations

import torch
from torch import nn

from pressroom.kernels import nvfp4 as kernels
from pressroom.model.quantization.base import LinearMethod, QuantizationMethod


class Nvfp4Method(QuantizationMethod):
    name = "nvfp4"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        if checkpoint_config is not None:
            raise ValueError("NVFP4 checkpoints are not loaded yet; --quantization nvfp4 quantizes a checkpoint of "
                             "plain weights at load.")
        super().__init__(checkpoint_config)

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        kernels.check_shape(layer.weight.shape[1])
        return Nvfp4LinearMethod()


class Nvfp4LinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        layer.register_buffer("weight_scale", None)
        layer.register_buffer("weight_global_scale", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data, layer.weight_scale, layer.weight_global_scale = kernels.quantize(layer.weight.data)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        args = layer.weight, layer.weight_scale, layer.weight_global_scale
        if flat.is_cuda:
            from pressroom.kernels.triton.quant_gemv import nvfp4_linear
            y = nvfp4_linear(flat, *args, bias)
        else:
            y = kernels.reference(flat, *args, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the layer multiplies by, in fp32 (for tests and inspection)."""
        return kernels.dequantize(layer.weight.data, layer.weight_scale, layer.weight_global_scale)
