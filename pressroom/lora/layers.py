"""The low-rank updates of many adapters applied in one forward pass (Punica / S-LoRA's shrink and expand).

Each adaptable linear layer holds every device slot's A and B (`LoRASlots`); a forward hook adds, to the rows of
the step's tokens that run an adapter, scaling * B (A x) of that adapter's slot: one shrink (x A^T) and one
expand (. B^T) per adapter present in the step, the rows of each gathered once per step (`LoRAStep`). A fused
layer (qkv_proj, gate_up_proj) keeps its slices side by side: slice j's A rows at [j R, j R + r) and its B
columns there too, B zero elsewhere, so one product serves every slice (the zeros add exact zeros).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pressroom.lora.adapter import LoRAUpdate, layer_slices
from pressroom.model.layers.linear import LinearBase


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """A step's adapters: (slot, rows) per adapter present, rows the flat token indices that run it (None:
    every token of the step)."""
    groups: tuple[tuple[int, torch.Tensor | None], ...]


_STEP: LoRAStep | None = None


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
    """One linear layer's adapters in `num_slots` slots: a [slots, S R, in], b [slots, out, S R] (S slices, R the
    largest rank), scaling folded into b."""

    def __init__(self, layer: LinearBase, num_slots: int, max_rank: int, dtype: torch.dtype, device) -> None:
        self.slices, self.max_rank = layer_slices(layer), max_rank
        width = len(self.slices) * max_rank
        self.a = torch.zeros(num_slots, width, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, layer.out_features, width, dtype=dtype, device=device)
        self.handle = layer.register_forward_hook(self._add_updates)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, update: LoRAUpdate) -> None:
        j = self.slices.index((update.offset, update.size))
        rank, col = update.a.shape[0], j * self.max_rank
        self.a[slot, col:col + rank] = update.a.to(self.a.dtype)
        self.b[slot, update.offset:update.offset + update.size, col:col + rank] = \
            (update.b * update.scaling).to(self.b.dtype)

    def _add_updates(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = _STEP
        if step is None or not step.groups:
            return None
        x = inputs[0]
        for slot, rows in step.groups:
            if rows is None:
                output = output + (x @ self.a[slot].t()) @ self.b[slot].t()
            else:
                delta = (x.index_select(0, rows) @ self.a[slot].t()) @ self.b[slot].t()
                output = output.index_add(0, rows, delta.to(output.dtype))
        return output
