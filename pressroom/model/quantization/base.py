"""The interface a quantization method implements (vLLM's shape: a method per layer kind).

A `QuantizationMethod` is chosen once per model (by `--quantization`, or by the checkpoint's
`quantization_config`). After the model is built, the loader asks it for each layer's method
(`layer_method`); today only linear layers ask, and a `LinearMethod` decides how that layer holds its
weight (`create_weights`, before loading), takes a checkpoint's quantized rows (`store_rows`), transforms
the weight once every row is in (`process_weights_after_loading`) and multiplies with it (`apply`). Layers
the method returns None for stay dense. Other layer kinds (experts, embeddings) would get methods of
their own here; they stay dense today.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn


class LinearMethod:
    """How one linear layer (a `LinearBase`: `weight` [out, in], `bias` or None) holds and applies its weight."""

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: replace or add the layer's tensors (the dense `weight` is there already)."""

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        """Take checkpoint rows [row, row + n) that come quantized (`loaded` is already this rank's slice);
        False: they are not this method's, the layer stores them densely."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every row is loaded: quantize, repack or check the weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] (+ bias, when given) in x's dtype."""
        raise NotImplementedError


class QuantizationMethod:
    """One quantization scheme for a whole model. Subclasses set `name` and override what they need.

    `checkpoint_config` is the checkpoint's `quantization_config` (a dict) when it has one, else None: a
    method that quantizes at load ("online") ignores it."""

    name: ClassVar[str] = ""

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        self.checkpoint_config = checkpoint_config

    def check_device(self, device: str, dtype: torch.dtype) -> None:
        """Raise a ValueError when this method cannot run on `device` with activations of `dtype`."""

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the module named `prefix` (a `LinearBase` today); None leaves it dense."""
        return None

    def checkpoint_weights(self, model: nn.Module, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors as the model's loaders should see them (e.g. weights paired with their
        scales into one quantized weight). Default: as they come."""
        yield from weights


def loads_into(model: nn.Module, name: str, method: type[LinearMethod]) -> bool:
    """Whether the checkpoint tensor `name` loads into a linear layer's weight that `method` holds (there
    it stays quantized; elsewhere it is dequantized)."""
    target = model.checkpoint_target(name)[0] if hasattr(model, "checkpoint_target") else name
    owner, _, attr = target.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return attr == "weight" and isinstance(getattr(module, "quant_method", None), method)
