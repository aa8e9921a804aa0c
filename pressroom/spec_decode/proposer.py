"""What a drafter offers the engine: up to K next tokens for a request, given its context."""
from __future__ import annotations

from typing import Protocol

from pressroom.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Draft tokens to follow `token_ids` (at most `max_drafts`; none is a valid answer)."""
        ...


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        from pressroom.spec_decode.ngram import NgramProposer
        return NgramProposer(config)
    raise ValueError(f"Unknown speculative method {config.method!r}.")
