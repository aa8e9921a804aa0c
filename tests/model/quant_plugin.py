"""A quantization plug-in for the tests, loaded by module path (`quant_plugin:GridMethod`) or through a fake
installed package's entry point: it rounds every linear weight to multiples of GRID after loading."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pressroom.model.quantization import LinearMethod, QuantizationMethod

GRID = 1 / 8


def round_to_grid(w: torch.Tensor) -> torch.Tensor:
    return torch.round(w / GRID) * GRID


class GridLinear(LinearMethod):
    def process_weights_after_loading(self, layer) -> None:
        layer.weight.data = round_to_grid(layer.weight.data)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


class GridMethod(QuantizationMethod):
    name = "grid"

    def layer_method(self, layer, prefix):
        return GridLinear() if prefix.endswith("_proj") else None


class NotAMethod:
    pass
