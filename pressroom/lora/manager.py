"""The worker's adapters: `max_loras` device slots (least recently used out first) filled from a CPU pool of read
adapters (`max_cpu_loras`, likewise), each adapter read from its path the first time a request names it.

A step's requests name their adapters (`LoRARequest`, or None: the base model); `step` gives the slots and
rows the layers' hooks apply (layers.py). An adapter that cannot be read fails the requests naming it, with
the reason (adapter.py's ValueError)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from pressroom.config import LoRAConfig
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.lora.adapter import LoRAAdapter, load_peft_adapter
from pressroom.lora.layers import LoRASlots, LoRAStep
from pressroom.lora.request import LoRARequest
from pressroom.model.layers.linear import LinearBase


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device) -> None:
        if get_tp_size() > 1:
            raise ValueError("LoRA adapters are served on one rank for now; drop --enable-lora or "
                             "--tensor-parallel-size.")
        self.model, self.config = model, config
        self.layers = {name: LoRASlots(m, config.max_loras, config.max_lora_rank, dtype, device)
                       for name, m in model.named_modules() if isinstance(m, LinearBase) and ".layers." in name}
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no decoder linear layers an adapter could update.")
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, least recent first
        self.pool: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recent first
        self.device = device

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Reads (or finds in the pool) the adapter; a ValueError says why it cannot serve."""
        adapter = self.pool.get(request.lora_int_id)
        if adapter is None:
            adapter = load_peft_adapter(request.lora_name, request.lora_path, self.model, self.config.max_lora_rank)
            self.pool[request.lora_int_id] = adapter
            if len(self.pool) > self.config.pool_size:
                self.pool.popitem(last=False)
        self.pool.move_to_end(request.lora_int_id)
        return adapter

    def step(self, loras: Sequence[LoRARequest | None], query_ends: Sequence[int]) -> LoRAStep | None:
        """The token slots of a step whose i-th request (tokens up to query_ends[i]) runs loras[i]; None for a step
        of the base model alone."""
        wanted = {r.lora_int_id: r for r in loras if r is not None}
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step holds {len(wanted)} adapters, more than --max-loras {self.config.max_loras}.")
        slot_of = {lora_id: self._slot(request, set(wanted)) for lora_id, request in wanted.items()}
        counts = torch.tensor([b - a for a, b in zip([0, *query_ends[:-1]], query_ends)])
        per_request = torch.tensor([slot_of[r.lora_int_id] if r is not None else -1 for r in loras])
        token_slots = torch.repeat_interleave(per_request, counts).to(self.device)
        return LoRAStep(token_slots, self.config.max_loras)

    def _slot(self, request: LoRARequest, in_step: set[int]) -> int:
        """The adapter's device slot, written there (over the least recently used one not in this step) if
        it holds none."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        adapter = self.add(request)
        if len(self.slots) < self.config.max_loras:
            slot = len(self.slots)
        else:
            victim = next(i for i in self.slots if i not in in_step)
            slot = self.slots.pop(victim)
        for layer in self.layers.values():
            layer.clear(slot)
        for update in adapter.updates:
            self.layers[update.module].write(slot, update)
        self.slots[lora_id] = slot
        return slot

