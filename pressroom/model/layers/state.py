"""The base of layers that keep a fixed-size recurrent state per request (Mamba1/Mamba2 mixers, Gated DeltaNet,
Kimi Delta Attention) instead of a paged KV cache.

A layer declares its state tensors (`state_shapes`: per request, e.g. a conv state and an SSM state); the model
runner allocates each as [num_slots, *shape] and binds them (`bind_states`). In its forward the layer projects
every token, then advances the states with `run_rounds(mix, *per_token_tensors)`: `mix(round, *tensors)` runs
one round's tokens (packed by `round.query_start_loc`, decodes first) against the slots `round.slots`, reading
each request's state from its slot and writing it back; `run_rounds` gathers each round's rows, scatters the
outputs, and copies checkpoints after the rounds that end at a prefix-cache boundary (attention/state.py).
Slot 0 is padding (CUDA graphs' padded rows point at it); a fresh request's slot is zeroed by the runner.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from pressroom.attention.backend import get_state_metadata
from pressroom.attention.state import StateRound
from pressroom.kernels import ssm


def on_triton(x: torch.Tensor) -> bool:
    """Whether the recurrent kernels run in Triton for `x` (CUDA tensors); the torch forms otherwise. Tests
    patch this one switch to run the Triton kernels under the CPU interpreter."""
    return x.is_cuda


def pool_kernels(x: torch.Tensor) -> ModuleType:
    """The SSM one-token kernels on state pools for x (kernels/triton/ssm.py or kernels/ssm.py: same signatures)."""
    if on_triton(x):
        from pressroom.kernels.triton import ssm as triton_ssm
        return triton_ssm
    return ssm


def prefill_kernels(x: torch.Tensor) -> ModuleType:
    """The SSM packed-prefill kernels for x (kernels/triton/ssm_prefill.py or kernels/ssm.py)."""
    if on_triton(x):
        from pressroom.kernels.triton import ssm_prefill
        return ssm_prefill
    return ssm


@dataclass(frozen=True, slots=True)
class StateShape:
    """One tensor of a layer's state, per request."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class RecurrentLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}  # name -> [num_slots, *shape], bound by the model runner

    def state_shapes(self) -> dict[str, StateShape]:
        """The state one request keeps in this layer (names are the layer's own)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state_shapes().values())

    def reserve_draft_rows(self, num_drafts: int) -> None:
        """Lets the state take a speculative step of 1 + `num_drafts` tokens whose rejected tail is simply
        computed again the next step. A true recurrence cannot: its state after a rejected draft is not its
        state before it (that would take a state per draft position, rolled back on rejection)."""
        raise ValueError(f"Speculative decoding is not supported for models with recurrent layers (Mamba, Gated "
                         f"DeltaNet, KDA; here {type(self).__name__}): verifying drafts would need a state per draft "
                         "position rolled back on rejection. Drop --speculative-config.")

    def bind_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = states

    def run_rounds(self, mix: Callable[..., torch.Tensor], *tokens: torch.Tensor) -> torch.Tensor:
        """Advances the states over the step's tokens: `mix(round, *tensors)` for each round, `tokens` sliced to
        its rows (each [num_tokens, ...]); returns mix's outputs for every token, in the step's order."""
        rounds = get_state_metadata().rounds
        if len(rounds) == 1 and rounds[0].rows is None:
            out = mix(rounds[0], *tokens)
            self._save(rounds[0])
            return out
        out = None
        for r in rounds:
            part = mix(r, *(t.index_select(0, r.rows) for t in tokens))
            if out is None:
                out = part.new_empty((tokens[0].shape[0], *part.shape[1:]))
            out.index_copy_(0, r.rows, part)
            self._save(r)
        return out

    @staticmethod
    def decodes_then_prefills(r: StateRound, out: torch.Tensor, decode: Callable[..., torch.Tensor],
                              prefill: Callable[..., torch.Tensor], *tokens: torch.Tensor) -> torch.Tensor:
        """Fills `out` for a round: `decode(*rows, slots)` on its decode rows (the first `r.num_decodes`, one token
        each), `prefill(*rows, slots, cu_seqlens)` on the rest, each given its own rows of `tokens`."""
        decodes, total = r.num_decodes, out.shape[0]
        if decodes:
            out[:decodes] = decode(*(t[:decodes] for t in tokens), r.slots[:decodes])
        if total > decodes:
            out[decodes:] = prefill(*(t[decodes:] for t in tokens), r.slots[decodes:], r.cu_seqlens[decodes:] - decodes)
        return out

    def _save(self, r: StateRound) -> None:
        if r.saves is None:
            return
        live, checkpoints = r.saves
        for t in self.states.values():
            t.index_copy_(0, checkpoints, t.index_select(0, live))
