"""Prompt lookup (n-gram) drafting: continue the context the way it continued last time.

The longest suffix of the context (prompt_lookup_max down to prompt_lookup_min tokens) that also
occurs earlier is looked up, and the tokens that followed its latest earlier occurrence are the
draft. No model, no probabilities: the proposal is deterministic (q is one-hot).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pressroom.config import SpeculativeConfig
from pressroom.worker.proposer import Draft, DraftRequest, Proposer


class NgramProposer(Proposer):
    gives_probabilities = False
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        drafts = {r.req_id: Draft(self.lookup(r.token_ids, r.max_drafts)) for r in requests}
        return {rid: d for rid, d in drafts.items() if d.token_ids}

    def forget(self, req_ids: Iterable[str]) -> None:
        pass  # stateless

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        k = min(self.k, max_drafts)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._latest_earlier_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []

    @staticmethod
    def _latest_earlier_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the latest earlier occurrence of the last n tokens that has a token after it."""
        windows = sliding_window_view(tokens[:-1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        return int(hits[-1]) if len(hits) else None
