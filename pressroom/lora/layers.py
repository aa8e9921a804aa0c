"""The low-rank updates of many adapters applied in one forward pass (Punica / S-LoRA's shrink and expand).

Each adaptable linear layer holds every device slot's A and B (`LoRASlots`); a forward hook adds to each token's
output scaling * B (A x) of its adapter's slot. All slots at once, in two products: the shrink x A_all^T over
every slot's rows, masked to the token's own slot's (`LoRAStep.mask`: zeros elsewhere, so the others add exact
zeros), then the expand by B_all. Two products a layer whatever the adapters' number: on the CPU a step's small
products cost their calls more than their arithmetic. A fused layer (qkv_proj, gate_up_proj) keeps its slices
side by side: slice j's A rows at [j R, j R + r) and its B columns there too, B zero elsewhere. On CUDA the products
read only each token's own slot instead (kernels/triton/lora.py; `_add_updates` says which kernel when).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pressroom.lora.adapter import LoRAUpdate, layer_slices
from pressroom.model.layers.linear import LinearBase

if TYPE_CHECKING:  # Triton is imported where CUDA runs a step (lazily: the CPU needs none)
    from pressroom.kernels.triton.lora import SlotGroups


@dataclass(slots=True)
class LoRAStep:
    """A step's adapters: the slot of each of its tokens (-1: the base model). Inside a CUDA graph `token_slots` is
    a view of the graph's input buffer, and the grouping by slot is computed in the graph from it."""
    token_slots: torch.Tensor  # [tokens] int64, on the device
    num_slots: int
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _groups: SlotGroups | None = None

    def groups(self) -> SlotGroups:
        """The tokens grouped by slot for the grouped kernels (computed on the device once a step, for every layer)."""
        if self._groups is None:
            from pressroom.kernels.triton.lora import group_by_slot
            self._groups = group_by_slot(self.token_slots, self.num_slots)
        return self._groups

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, num_slots * width]: 1 over the columns of each token's slot, 0 elsewhere (made once a step
        for each layer width)."""
        found = self._masks.get(width)
        if found is None:
            columns = torch.arange(self.num_slots * width, device=self.token_slots.device) // width
            found = self._masks[width] = (columns[None, :] == self.token_slots[:, None]).to(dtype)
        return found


_STEP: LoRAStep | None = None
# On CUDA, which kernel for how many tokens (the one home of the rule): a step of at most this many tokens (decode
# graphs up to batch 16) takes the fused kernel, one launch a layer with no grouping, whose cost grows with the tokens
# (each token's programs re-read its slot's A from L2: about 3 MB a token and layer at the 8B shape); larger steps
# group their tokens by slot once a step and take the grouped kernels (two launches a layer, each slot's A and B read
# once per tile of up to 32 of its tokens, on the tensor cores).
FUSED_MAX_TOKENS = 16


def current_step() -> LoRAStep | None:
    """The adapters the forward pass now running applies (None: the base model)."""
    return _STEP


@contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """The adapters the forward passes inside run with (None or no groups: the base model alone)."""
    global _STEP
    previous, _STEP = _STEP, step
    try:
        yield
    finally:
        _STEP = previous


class LoRASlots:
    """One linear layer's adapters in `num_slots` slots: a [slots * S R, in], b [out, slots * S R] (S slices, R the
    largest rank; slot s's columns at [s S R, (s + 1) S R)), scaling folded into b."""

    def __init__(self, layer: LinearBase, num_slots: int, max_rank: int, dtype: torch.dtype, device) -> None:
        self.slices, self.max_rank = layer_slices(layer), max_rank
        self.width = len(self.slices) * max_rank
        # the kernels' view of the slices: (first output feature, features), on the device for graph replays
        self.slice_table = torch.tensor(self.slices, dtype=torch.int32, device=device)
        self.largest_slice = max(size for _, size in self.slices)
        self.a = torch.zeros(num_slots * self.width, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(layer.out_features, num_slots * self.width, dtype=dtype, device=device)
        self.handle = layer.register_forward_hook(self._add_updates)

    def _columns(self, slot: int) -> slice:
        return slice(slot * self.width, (slot + 1) * self.width)

    def clear(self, slot: int) -> None:
        self.a[self._columns(slot)].zero_()
        self.b[:, self._columns(slot)].zero_()

    def write(self, slot: int, update: LoRAUpdate) -> None:
        j = self.slices.index((update.offset, update.size))
        rank, col = update.a.shape[0], slot * self.width + j * self.max_rank
        self.a[col:col + rank] = update.a.to(self.a.dtype)
        self.b[update.offset:update.offset + update.size, col:col + rank] = \
            (update.b * update.scaling).to(self.b.dtype)

    def _add_updates(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = _STEP
        if step is None:
            return None
        x = inputs[0]
        if x.is_cuda:
            from pressroom.kernels.triton.lora import add_lora_fused, add_lora_grouped
            layout = (self.slice_table, self.largest_slice, self.max_rank)
            if x.shape[0] <= FUSED_MAX_TOKENS:
                add_lora_fused(output, x, self.a, self.b, step.token_slots, *layout)
            else:
                add_lora_grouped(output, x, self.a, self.b, step.groups(), *layout)
            return output
        shrunk = (x @ self.a.t()) * step.mask(self.width, x.dtype)
        return output + (shrunk @ self.b.t()).to(output.dtype)
