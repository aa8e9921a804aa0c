"""NVFP4 weights (`--quantization nvfp4`, or an NVIDIA ModelOpt checkpoint with `quant_algo: "NVFP4"`):
weight-only, activations stay in their dtype. The layer methods and their kernels are fp4.py's.

Online: each linear layer and each layer's experts load dense (this rank's slice), then are quantized with
NVIDIA's recipe (kernels/nvfp4.py): E2M1 values in blocks of 16 inputs, each block scaled by an FP8 e4m3 value and
the matrix (a rank's stacked slice; an expert's gate and up together) by one fp32 global scale, 4.5 bits a weight.

Checkpoints, ModelOpt's export (`quantization_config: {"quant_method": "modelopt", "quant_algo": "NVFP4",
"group_size": 16, ...}` in config.json, or hf_quant_config.json's `quantization`): each quantized linear layer X
(and each expert's matrix, per expert under the model's names) ships `X.weight` uint8 [out, in / 2] (the even input
in the low nibble), `X.weight_scale` float8_e4m3fn [out, in / 16], `X.weight_scale_2` fp32 (one value: the global
scale, a multiplier) and `X.input_scale` (a static activation scale for FP4 activations: not used, activations are
not quantized). They are read without dequantizing, a rank only its rows and blocks; each part keeps its own global
scale (one per row in the layer). Modules named by `exclude_modules` / `ignore` stay dense.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pressroom.kernels import nvfp4 as kernels
from pressroom.model.lazy_weight import LazyWeight
from pressroom.model.quantization.base import loads_into
from pressroom.model.quantization.fp4 import Fp4LinearMethod, Fp4Method, Fp4MoeMethod, Fp4Weight, lazy_fp4

_SCALES = (".weight_scale", ".weight_scale_2")
# static activation scales (FP4 activations) and a KV cache's FP8 scales: this method quantizes neither
_DROPPED = (".input_scale", ".k_scale", ".v_scale")


class Nvfp4LinearMethod(Fp4LinearMethod):
    fmt = "nvfp4"


class Nvfp4Method(Fp4Method):
    name = "nvfp4"
    linear_method = Nvfp4LinearMethod

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        super().__init__(checkpoint_config)
        config = checkpoint_config or {}
        if self.serialized:
            algo, group = str(config.get("quant_algo", "")).upper(), int(config.get("group_size", kernels.BLOCK))
            if algo != "NVFP4" or group != kernels.BLOCK:
                raise ValueError(f"ModelOpt checkpoints are read in NVFP4 with groups of {kernels.BLOCK} only; this "
                                 f"one is quant_algo {algo or None!r} with group_size {group}.")
        self.kept_dense = list(config.get("exclude_modules") or config.get("ignore") or [])

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, LazyWeight]) -> Iterable[tuple[str, Any]]:
        tensor = tensors[name]
        if name.endswith(_SCALES + _DROPPED):
            return ()
        if not (name.endswith(".weight") and tensor.dtype == torch.uint8):
            return ((name, tensor),)
        base = name.removesuffix(".weight")
        missing = [base + s for s in _SCALES if base + s not in tensors]
        if missing:
            raise ValueError(f"{name} is packed FP4 but the checkpoint lacks {', '.join(missing)} to scale it.")
        keep = loads_into(model, name, (Nvfp4LinearMethod, Fp4MoeMethod))
        return ((name, _lazy_weight(tensor, tensors[base + ".weight_scale"], tensors[base + ".weight_scale_2"],
                                    keep, name)),)


def _lazy_weight(weight: LazyWeight, scale: LazyWeight, scale_2: LazyWeight, keep: bool, name: str) -> LazyWeight:
    rows, half = weight.shape
    if tuple(scale.shape) != (rows, 2 * half // kernels.BLOCK):
        raise ValueError(f"{name}: NVFP4 weight of shape {(rows, half)} (packed) with block scales "
                         f"{tuple(scale.shape)}; expected [{rows}, {2 * half // kernels.BLOCK}].")
    global_scale = scale_2.load().float().reshape(-1)
    if global_scale.numel() != 1:
        raise ValueError(f"{name}.weight_scale_2 has {global_scale.numel()} values; NVFP4's global scale is one.")

    def read(r0: int, r1: int, b0: int, b1: int) -> Fp4Weight:
        half_block = kernels.BLOCK // 2
        packed = weight.narrow(0, r0, r1 - r0).narrow(1, b0 * half_block, (b1 - b0) * half_block).load()
        block_scale = scale.narrow(0, r0, r1 - r0).narrow(1, b0, b1 - b0).load()
        if block_scale.dtype != kernels.FP8:
            block_scale = block_scale.view(kernels.FP8) if block_scale.dtype == torch.uint8 else \
                block_scale.float().to(kernels.FP8)
        return Fp4Weight(packed.contiguous(), block_scale.contiguous(), global_scale.expand(r1 - r0).contiguous())

    return lazy_fp4((rows, 2 * half), kernels.BLOCK, read, keep, name)
