"""Weights a quantization method may take, made without their dense bytes while the loader builds a model.

Inside `DeferredWeights` (opened by model/loader.py around the model's construction) `held_weight` gives a
linear layer's `weight` and the experts' `w13` / `w2` as stand-ins: one element of the default dtype on the
default device, expanded to the dense shape, so the shape, dtype and device a method's `create_weights` reads
are the real ones while nothing of the dense size exists. The loader then hands the layers to their methods
(which put their own tensors in the parameter's `.data`) and `allocate` gives every stand-in still in the model
(a layer no method took, or a method that kept the dense weight) its dense tensor, as the layer would have made
it: same Parameter object (its `weight_loader` and other attributes stay), shape, dtype and device. A GGUF whose
projections may stay in their GGML forms leaves the linear layers' stand-ins in place (`allocate`'s `later`): a
layer allocates its dense weight only when some rows come dense (LinearBase._allocate_weight). Not meta
tensors: a meta parameter cannot take a real tensor's `.data`, and methods place their tensors on the weight's
device. A stand-in is read-only (writing into it raises: all its elements share one), so a forgotten `allocate`
fails loudly at loading. Outside the context `held_weight` is a plain dense parameter.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar

import torch
from torch import nn

_ACTIVE: ContextVar[DeferredWeights | None] = ContextVar("deferred_weights", default=None)


class DeferredWeights:
    """While open: the held weights layers make are stand-ins; `allocate(model)` gives the ones no method took
    their dense tensors."""

    def __init__(self) -> None:
        self._elements: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # each stand-in's one element
        self.deferred_bytes = 0  # the dense bytes of every stand-in made

    def __enter__(self) -> DeferredWeights:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def stand_in(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One shared element of the default dtype and device, expanded to `shape`."""
        key = (torch.get_default_dtype(), torch.get_default_device())
        if key not in self._elements:
            self._elements[key] = torch.empty((), dtype=key[0], device=key[1])
        element = self._elements[key]
        self.deferred_bytes += element.element_size() * torch.Size(shape).numel()
        return element.expand(shape)

    def is_stand_in(self, tensor: torch.Tensor) -> bool:
        # the storage itself, not its address: on the meta device every address is 0
        storage = tensor.untyped_storage()._cdata
        return any(storage == e.untyped_storage()._cdata for e in self._elements.values())

    def allocate(self, model: nn.Module, later: Iterable[nn.Parameter] = ()) -> int:
        """Every parameter of `model` that is still a stand-in, but those in `later` (their layers allocate them
        when they need to), becomes a dense tensor; returns the bytes allocated."""
        kept = {id(p) for p in later}
        allocated = 0
        for param in model.parameters():
            if id(param) not in kept and self.is_stand_in(param):
                allocate_dense(param)
                allocated += param.numel() * param.element_size()
        return allocated


def allocate_dense(param: nn.Parameter) -> None:
    """The parameter's dense tensor in place of its stand-in: its shape, dtype and device, uninitialised (as
    `torch.empty` makes it); the Parameter and its attributes stay."""
    param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)


def is_expanded(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is one element (a stand-in; a layer whose weight no method holds makes
    no other such weight)."""
    return tensor.dim() > 0 and not any(tensor.stride())


def held_weight(*shape: int) -> nn.Parameter:
    """A layer's weight that a quantization method may take (a linear layer's, the experts' stacked matrices):
    dense in the default dtype and device, or inside `DeferredWeights` a stand-in of that shape."""
    active = _ACTIVE.get()
    data = torch.empty(shape) if active is None else active.stand_in(shape)
    return nn.Parameter(data, requires_grad=False)
