"""The interface a quantization method implements (vLLM's shape: a method per layer kind).

A `QuantizationMethod` is chosen once per model (by `--quantization`, or by the checkpoint's
`quantization_config`). After the model is built, the loader asks it for each layer's method
(`layer_method`); today only linear layers ask, and a `LinearMethod` decides how that layer holds its
weight (`create_weights`, before loading), takes a checkpoint's quantized rows (`store_rows`), transforms
the weight once every row is in (`process_weights_after_loading`) and multiplies with it (`apply`). Layers
the method returns None for stay dense. The routed experts of a mixture-of-experts layer (a `FusedMoE`) ask
`moe_method` for a `MoeMethod`, the same four steps over their stacked `w13` and `w2`. Embeddings and LM heads
have no methods: they stay dense.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pressroom.model.lazy_weight import Index, LazyWeight


class LinearMethod:
    """How one linear layer (a `LinearBase`: `weight` [out, in], `bias` or None) holds and applies its weight."""

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: replace or add the layer's tensors. `weight` gives the dense shape, dtype and device; under
        the loader it is a stand-in with no data (model/layers/deferred.py): replace its `.data`, or leave it and
        the loader allocates it dense."""

    def store_rows(self, layer: nn.Module, row: int, loaded: Any) -> bool:
        """Take checkpoint rows [row, row + n) that come quantized (`loaded` is already this rank's slice);
        False: they are not this method's, the layer stores them densely."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every row is loaded: quantize, repack or check the weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] (+ bias, when given) in x's dtype."""
        raise NotImplementedError


class MoeMethod:
    """How one `FusedMoE` holds and applies its experts: `w13` [experts, 2 * inter, hidden] (gate rows, then up
    rows) and `w2` [experts, hidden, inter], this rank's experts and slices."""

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: replace or add the layer's tensors (`w13` and `w2` are stand-ins with the dense shape,
        dtype and device, as a linear layer's `weight` is)."""

    def store_rows(self, layer: nn.Module, param: str, expert: int, row: int, loaded: Any) -> bool:
        """Take rows [row, row + n) of local expert `expert`'s `param` ("w13" or "w2"), already this rank's
        slice; False: the layer stores them densely."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every expert is loaded: quantize, repack or check."""

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] through each token's chosen experts (global ids [tokens, top_k], fp32 weights)."""
        raise NotImplementedError


class QuantizationMethod:
    """One quantization scheme for a whole model. Subclasses set `name` and override what they need.

    `checkpoint_config` is the checkpoint's `quantization_config` (a dict) when it has one, else None: a
    method that quantizes at load ("online") ignores it."""

    name: ClassVar[str] = ""

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        self.checkpoint_config = checkpoint_config
        self.serialized = checkpoint_config is not None  # the checkpoint ships its weights quantized

    def check_device(self, device: str, dtype: torch.dtype) -> None:
        """Raise a ValueError when this method cannot run on `device` with activations of `dtype`."""

    def layer_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the module named `prefix` (a `LinearBase` today); None leaves it dense."""
        return None

    def moe_method(self, layer: nn.Module, prefix: str) -> MoeMethod | None:
        """The method for the routed experts named `prefix` (a `FusedMoE`); None leaves them dense."""
        return None

    def checkpoint_weights(self, model: nn.Module, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors as the model's loaders should see them: from a quantized checkpoint, each as
        `loads_as` says (a weight and its scales joined into one lazy tensor); otherwise as they come."""
        if not self.serialized:
            yield from weights
            return
        tensors = dict(weights)  # lazy: names and shapes only, nothing read yet
        for name in tensors:
            yield from self.loads_as(model, name, tensors)

    def loads_as(self, model: nn.Module, name: str, tensors: dict[str, Any]) -> Iterable[tuple[str, Any]]:
        """What checkpoint tensor `name` (of all the checkpoint's `tensors`) loads as: nothing for a part read
        with its weight (a scale) or not used, one lazy tensor joining a quantized weight with its parts, or the
        tensor as it is. Default: as it is."""
        return ((name, tensors[name]),)


def lazy_quantized(shape: tuple[int, ...], kept_dtype: torch.dtype, read: Callable[[Index], Any], keep: bool
                   ) -> LazyWeight:
    """A checkpoint's quantized weight as one lazy tensor of the dense shape: `read(index)` reads the rows and
    columns asked for in the format's form (which can `dequantize()`). Kept (a layer of the method holds the
    weight), that form goes to the layer; otherwise it is dequantized to fp32 (a dense parameter, or
    --quantization none)."""
    def read_index(index: Index) -> Any:
        part = read(index)
        return part if keep else part.dequantize()

    return LazyWeight(shape, kept_dtype if keep else torch.float32, read_index)


# the parameters a layer method holds: a linear layer's weight, the experts' stacked matrices
_HELD = ("weight", "w13", "w2")


def loads_into(model: nn.Module, name: str, method: type | tuple[type, ...]) -> bool:
    """Whether the checkpoint tensor `name` loads into a linear layer's weight (or an expert's matrix) that a
    `method` holds (there it stays quantized; elsewhere it is dequantized)."""
    target = model.checkpoint_target(name)[0] if hasattr(model, "checkpoint_target") else name
    owner, _, attr = target.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return attr in _HELD and isinstance(getattr(module, "quant_method", None), method)


# a pressroom stacked layer -> the checkpoint modules it stacks (an exclusion may name any of them)
_STACKED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                  "fused_qkv_a_proj": ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "indexer.wk")}  # DeepSeek's MLA


def excluded(prefix: str, patterns: Iterable[str]) -> bool:
    """Whether the module `prefix` is among a checkpoint's unquantized modules (HF's `modules_to_not_convert`,
    ModelOpt's `exclude_modules` / `ignore`). A pattern names the module, one of its parents, or a part a stacked
    layer joins (q_proj for qkv_proj); it matches as a glob ("*self_attn*"), as HF's prefix regex up to a module
    boundary ("model.layers.*.self_attn") or as a suffix ("o_proj")."""
    head, _, last = prefix.rpartition(".")
    names = [prefix, *(f"{head}.{p}" if head else p for p in _STACKED_PARTS.get(last, ()))]
    names += [prefix[:i] for i, c in enumerate(prefix) if c == "."]
    return any(_matches(name, pattern) for pattern in patterns for name in names)


def _matches(name: str, pattern: str) -> bool:
    if fnmatch.fnmatchcase(name, pattern) or name.endswith(pattern):
        return True
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:  # a glob such as "*self_attn*" is no regex
        return False
