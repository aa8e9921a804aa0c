"""The per-step metadata of layers that keep a recurrent state per request (Mamba's conv and SSM states, a
delta rule's matrix) instead of a KV cache: where each request's state lives and which tokens advance it.

Each request owns a live state slot (a row of every recurrent layer's state tensors). A step's tokens advance
it in one pass, or, where prefix caching checkpoints the state at block boundaries inside a request's chunk, in
rounds: round r runs the r-th segment of every request, and after it the states of the requests whose segment
ended at a boundary are copied from their live slots to checkpoint slots. Rows are ordered as the step's are:
decodes (one token each) first, then prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StateRound:
    """One pass over some of the step's tokens, one segment per request that has one."""
    rows: torch.Tensor | None  # the step's token rows in this round, in order (None: every token, in order)
    query_start_loc: list[int]  # [requests + 1] over the round's tokens, host copy
    cu_seqlens: torch.Tensor  # the same on the device (int32)
    slots: torch.Tensor  # [requests] live state slots (int64, on the device)
    num_decodes: int  # the first `num_decodes` requests advance by exactly one token
    saves: tuple[torch.Tensor, torch.Tensor] | None = None  # (live slots, checkpoint slots) copied after it

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


@dataclass(slots=True)
class StateMetadata:
    rounds: list[StateRound]
    # [requests] every request's live slot, in the step's order (None: the one round's `slots`, which has them all)
    request_slots: torch.Tensor | None = None

    def slots_of_requests(self) -> torch.Tensor:
        """The live slot of each of the step's requests (a layer that reads states outside its rounds)."""
        if self.request_slots is not None:
            return self.request_slots
        if len(self.rounds) != 1 or self.rounds[0].rows is not None:
            raise ValueError("a step in several rounds must carry request_slots")
        return self.rounds[0].slots

    @classmethod
    def one_round(cls, query_start_loc: list[int], slots: list[int], device: torch.device | str,
                  num_decodes: int = 0) -> StateMetadata:
        """Every token in one pass, no checkpoints (a step without boundaries inside its chunks; tests)."""
        return cls([StateRound(None, list(query_start_loc),
                               torch.tensor(query_start_loc, dtype=torch.int32, device=device),
                               torch.tensor(slots, dtype=torch.int64, device=device), num_decodes)])

