"""One walk that copies a checkpoint's tensors into a model's parameters; each model supplies only its name map.

A name map says how the checkpoint's names meet the model's parameters: which tensors the model does without
(`skips`), the parameter a tensor loads into with the shard id of a stacked part (`checkpoint_target`: q/k/v into
qkv_proj, an expert's gate into FusedMoE's w13), and back, the checkpoint tensors a parameter is filled from
(`checkpoint_parts`, which says what a checkpoint lacks). A parameter with a `weight_loader` takes its tensor
itself (tensor-parallel slices, stacked parts, quantized rows); any other is copied whole.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from torch import nn

from pressroom.model.lazy_weight import materialize


class NameMap(Protocol):
    def skips(self, name: str) -> bool:
        """Whether the model does without checkpoint tensor `name` (rotary tables, a tied head's copy)."""
        ...

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """The parameter checkpoint tensor `name` loads into, and its shard id (None: the whole parameter)."""
        ...

    def checkpoint_parts(self, name: str) -> list[str]:
        """The checkpoint tensors parameter `name` is loaded from."""
        ...


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, Any]], names: NameMap | None = None
                       ) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters one by one, placed by `names` (default: the module's
    own map); returns the checkpoint names used."""
    names = names if names is not None else module
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, tensor in weights:
        if names.skips(name):
            continue
        target, shard = names.checkpoint_target(name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(module).__name__}.")
        load_tensor(param, tensor, shard, name)
        loaded.add(name)
    return loaded


def expected_names(module: nn.Module, names: NameMap | None = None) -> set[str]:
    """Every checkpoint tensor `module`'s parameters need (a stacked parameter needs each of its parts)."""
    names = names if names is not None else module
    params = module.named_parameters(remove_duplicate=False)
    return {part for name, _ in params for part in names.checkpoint_parts(name)}


def load_tensor(param: nn.Parameter, tensor: Any, shard: object, name: str) -> None:
    """Checkpoint tensor `name` into `param`: through its weight_loader (with the shard id of a stacked part), or
    copied whole; a ValueError names the tensor."""
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            _copy_whole(param, tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _copy_whole(param: nn.Parameter, tensor: Any) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}; the model expects {tuple(param.shape)}.")
    param.data.copy_(materialize(tensor))
