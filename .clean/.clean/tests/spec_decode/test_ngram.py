"""Prompt-lookup drafting: the longest earlier match of the context's suffix, latest occurrence first."""
from __future__ import annotations

import pytest

from pressroom.config import SpeculativeConfig
from pressroom.spec_decode.ngram import NgramProposer


def _proposer(k=3, lo=1, hi=4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_continues_the_latest_earlier_occurrence():
    assert _proposer().lookup([1, 2, 3, 4, 5, 1, 2, 3], 10) == [4, 5, 1]
    assert _proposer().lookup([1, 2, 9, 8, 1, 2, 7, 6, 1, 2], 10) == [7, 6, 1]  # latest match wins


def test_longest_suffix_first_and_limits():
    # "3 4" matches at 2 (followed by 9), "4" alone matches later (followed by 5); the longer one wins.
    assert _proposer().lookup([1, 3, 4, 9, 4, 5, 3, 4], 10) == [9, 4, 5]
    assert _proposer(k=5).lookup([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # runs out of context
    assert _proposer().lookup([1, 2, 3, 1, 2], 1) == [3]  # max_drafts (the request's remaining tokens)
    assert _proposer().lookup([1, 2, 3, 1, 2], 0) == []


def test_no_match_no_draft():
    assert _proposer().lookup([1, 2, 3, 4], 10) == []
    assert _proposer(lo=2).lookup([5, 1, 2, 3, 5], 10) == []  # only a 1-token match, below the minimum
    assert _proposer().lookup([7], 10) == []


def test_config_is_validated():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="telepathy")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="Unknown speculative_config"):
        SpeculativeConfig.from_value({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.from_value("{nope")
    assert SpeculativeConfig.from_value('{"num_speculative_tokens": 5}').num_speculative_tokens == 5
    with pytest.raises(ValueError, match="synthetic_acceptance_rates"):
        SpeculativeConfig(rejection_sample_method="synthetic")
    with pytest.raises(ValueError, match="synthetic_acceptance_rates"):
        SpeculativeConfig(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 1.5])
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft_model")
