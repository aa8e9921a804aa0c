"""The drafter interface the model runner owns: what it hands a proposer and what it gets back.

Drafters (spec_decode/) implement `Proposer`; worker/ never imports them. A proposer declares what it
can do instead of being probed for it: `works_on_device` (it drafts under async scheduling through
`propose_on_device`) and `aux_layers` (the target layers it conditions on: the runner asks the target
for their outputs in its forward pass and hands them over through `observe_features`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftRequest:
    req_id: str
    token_ids: list[int]  # every verified token: prompt and output
    max_drafts: int  # drafts past the request's max_tokens would be wasted
    params: SamplingParams


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab]: the distribution each draft token was drawn from; None for a
    # deterministic proposal (verification then treats q as one-hot).
    probs: torch.Tensor | None = None
    # Per draft token, the drafter's own estimate that it survives given the ones before it (dflash2);
    # None: the scheduler's acceptance estimates stand in.
    confidences: list[float] | None = None


@dataclass(slots=True)
class TargetStep:
    """One target step as a drafter that works on the device sees it (async scheduling): the step's
    query tokens, positions and attention metadata (block tables, context lengths), and for each
    request that sampled, the tokens it emitted, still on the device."""
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    sampled: list[int]  # batch index of each request that sampled
    num_drafts: list[int]  # per sampled request: the drafts it verified (the last of its query tokens)
    tokens: torch.Tensor | None  # [sampled, width]: accepted drafts then the target's token, padded
    counts: torch.Tensor | None  # [sampled] tokens each emitted
    params: list[SamplingParams]  # per sampled request
    draft_limits: list[int]  # per sampled request: drafts wanted for its next step (the budget's plan)
    # Per request of the batch (batch order): its id, its tokens known on the host (everything up to the
    # step before the one in flight) and the position of its first query token.
    req_ids: list[str]
    token_ids: list[list[int]]
    starts: list[int]


# Device drafts ([sampled, K]) and their q ([sampled, K, vocab], None when every row is greedy).
DeviceDrafts = tuple[torch.Tensor, torch.Tensor | None]


class Proposer(ABC):
    """A drafter: up to K next tokens per request, given its context."""
    # Drafts under async scheduling (`propose_on_device`), where nothing may wait for the host.
    works_on_device: ClassVar[bool] = False
    # Sampled drafts come with the distribution they were drawn from (`Draft.probs`); False: the proposal
    # is deterministic and verification takes q as one-hot.
    gives_probabilities: ClassVar[bool] = True
    # Its cache uses the target's block tables (the same block ids, in a tensor of its own) and writes up to
    # K positions past a request's step: the scheduler keeps those slots allocated.
    shares_block_tables: ClassVar[bool] = False

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        """Drafts for the requests that get any (an empty or missing draft is a valid answer)."""

    @abstractmethod
    def forget(self, req_ids: Iterable[str]) -> None:
        """The requests finished or were preempted: drop any state kept for them."""

    def propose_on_device(self, step: TargetStep) -> DeviceDrafts | None:
        """K drafts per sampled request of the step, left on the device; None when no row was drafted.
        Only where `works_on_device`."""
        raise NotImplementedError(f"{type(self).__name__} drafts from host token ids only.")

    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose output (the residual stream, HF's hidden_states[i + 1]) this drafter
        conditions on, in the order it reads them; empty: none, and `observe_features` is never called."""
        return ()

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        """The target features ([n, len(aux_layers) * width], the layers side by side) at the positions of
        the request that the step verified: every query token but a verification's rejected drafts."""
        raise NotImplementedError(f"{type(self).__name__} reads no target features.")

    # ---- costs and set-up the engine asks every drafter for (defaults: a drafter with no model) ----

    def kv_bytes_per_block(self) -> int:
        """KV-cache bytes per block of the drafter's own cache (it gets as many blocks as the target)."""
        return 0

    def profile_decode_steps(self, counts: list[int]) -> list[tuple[int, float]] | None:
        """Seconds to draft one more position for each batch size; None: drafting costs nothing to budget."""
        return None

    def profile_first_draft_steps(self, counts: list[int]) -> list[tuple[int, float]] | None:
        """Seconds of the first draft position where it costs more than the others (a mirroring pass)."""
        return None

    def profile_block_passes(self, counts: list[int]) -> list[tuple[int, float]] | None:
        """Seconds of a block drafter's shared pass for each batch size."""
        return None

    def capture_cudagraphs(self, compilation, max_num_seqs: int, max_num_batched_tokens: int) -> None:  # noqa: B027
        """Capture the drafter's own passes (CUDA); nothing to capture by default."""
