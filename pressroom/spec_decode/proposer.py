"""What a drafter offers the engine: up to K next tokens per request, given its context."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from pressroom.attention.backend import AttentionMetadata
from pressroom.config import SpeculativeConfig
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


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        """Drafts for the requests that get any (an empty or missing draft is a valid answer)."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """The requests finished or were preempted: drop any state kept for them."""
        ...

    # A drafter usable with async scheduling also has (see DraftModelProposer):
    # propose_on_device(step: TargetStep) -> tuple[drafts [sampled, K], q [sampled, K, vocab] | None] | None


def make_proposer(config: SpeculativeConfig | None, target) -> Proposer | None:
    """`target`: the target's ModelRunner (a draft model shares its device, dtype and block size)."""
    if config is None:
        return None
    if config.method == "ngram":
        from pressroom.spec_decode.ngram import NgramProposer
        return NgramProposer(config)
    if config.method == "draft_model":
        from pressroom.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config, target)
    if config.method == "dflash2":
        from pressroom.spec_decode.dflash2 import DFlash2Proposer
        return DFlash2Proposer(config, target)
    raise ValueError(f"Unknown speculative method {config.method!r}.")
