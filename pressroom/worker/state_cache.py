"""The recurrent layers' state tensors (model/layers/state.py) and each step's StateMetadata.

Every recurrent layer's state tensors have one row per slot of the engine core's StatePool (core/state_pool.py):
slot 0 is padding, then the live slots of running requests, then prefix checkpoints. A request the runner meets
for the first time starts from zeros, or from the checkpoint its prefix hit names; a step whose chunks pass a
checkpoint boundary runs its recurrent layers in rounds split there (attention/state.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pressroom.attention.state import StateMetadata, StateRound
from pressroom.core.outputs import NewRequestData
from pressroom.model.layers.state import RecurrentLayer

Piece = tuple[int, int, int]  # (first token row, end row, checkpoint slot written after it or -1)


class StateCache:
    def __init__(self, layers: list[RecurrentLayer], device: str) -> None:
        self.layers, self.device = layers, device
        self.num_slots = 0

    @classmethod
    def of(cls, model: nn.Module, device: str) -> StateCache | None:
        layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
        return cls(layers, device) if layers else None

    def reserve_draft_rows(self, num_drafts: int) -> None:
        """Every layer's state sized for speculative steps of 1 + num_drafts tokens, or a ValueError."""
        for layer in self.layers:
            layer.reserve_draft_rows(num_drafts)

    def bytes_per_slot(self) -> int:
        """One request's state over every recurrent layer."""
        return sum(layer.state_bytes() for layer in self.layers)

    def bind(self, num_slots: int) -> None:
        self.num_slots = num_slots
        for layer in self.layers:
            layer.bind_states({name: torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=self.device)
                               for name, s in layer.state_shapes().items()})

    def release(self) -> None:
        for layer in self.layers:
            layer.bind_states({})
        self.num_slots = 0

    def start_requests(self, new_requests: list[NewRequestData]) -> None:
        """Zeroes the live slots of requests that start from nothing; copies a checkpoint into the others'."""
        zeroed = [n.state_slot for n in new_requests if n.restore_slot < 0]
        restored = [(n.state_slot, n.restore_slot) for n in new_requests if n.restore_slot >= 0]
        if not zeroed and not restored:
            return
        zero_idx = torch.tensor(zeroed, dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for d, _ in restored], dtype=torch.int64, device=self.device)
        src = torch.tensor([s for _, s in restored], dtype=torch.int64, device=self.device)
        for layer in self.layers:
            for t in layer.states.values():
                if zeroed:
                    t.index_fill_(0, zero_idx, 0)
                if restored:
                    t.index_copy_(0, dst, t.index_select(0, src))

    def metadata(self, req_ids: list[str], slots: list[int], query_start_loc: list[int], num_decodes: int,
                 saves: dict[str, list[tuple[int, int]]]) -> StateMetadata:
        """The step's rounds: one over every token unless some request's chunk passes a checkpoint boundary
        before its end (then round r runs every request's r-th piece)."""
        pieces = [_pieces(query_start_loc[i], query_start_loc[i + 1], saves.get(rid, ()))
                  for i, rid in enumerate(req_ids)]
        if max((len(p) for p in pieces), default=1) == 1:
            meta = StateMetadata.one_round(query_start_loc, slots, self.device, num_decodes)
            meta.rounds[0].saves = self._saves([(slot, p[0][2]) for slot, p in zip(slots, pieces) if p[0][2] >= 0])
            return meta
        return StateMetadata([self._round(pieces, slots, r, num_decodes if r == 0 else 0)
                              for r in range(max(len(p) for p in pieces))],
                             torch.tensor(slots, dtype=torch.int64, device=self.device))

    def _round(self, pieces: list[list[Piece]], slots: list[int], r: int, num_decodes: int) -> StateRound:
        rows: list[int] = []
        loc, round_slots, writes = [0], [], []
        for slot, own in zip(slots, pieces):
            if r >= len(own):
                continue
            start, end, checkpoint = own[r]
            rows.extend(range(start, end))
            loc.append(loc[-1] + end - start)
            round_slots.append(slot)
            if checkpoint >= 0:
                writes.append((slot, checkpoint))
        dev = self.device
        return StateRound(torch.tensor(rows, dtype=torch.int64, device=dev), loc,
                          torch.tensor(loc, dtype=torch.int32, device=dev),
                          torch.tensor(round_slots, dtype=torch.int64, device=dev), num_decodes, self._saves(writes))

    def _saves(self, writes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not writes:
            return None
        return (torch.tensor([w[0] for w in writes], dtype=torch.int64, device=self.device),
                torch.tensor([w[1] for w in writes], dtype=torch.int64, device=self.device))


def _pieces(start: int, end: int, cuts: list[tuple[int, int]] | tuple) -> list[Piece]:
    """A request's token rows [start, end) cut after each checkpoint's offset."""
    out, prev = [], start
    for offset, checkpoint in cuts:
        out.append((prev, start + offset, checkpoint))
        prev = start + offset
    if prev < end or not out:
        out.append((prev, end, -1))
    return out
