"""The adaptive speculative budget: every likely draft when a step is memory-bound, none when it is
compute-bound and the batch is large, and estimates that follow what verification observes."""
from __future__ import annotations

from pressroom.spec_decode.budget import AdaptiveBudget

FLAT = [(1, 0.010), (64, 0.010), (512, 0.011)]  # memory-bound: extra tokens are almost free
LINEAR = [(1, 0.001), (64, 0.064), (512, 0.512)]  # compute-bound: time grows with every token


def _learned(budget: AdaptiveBudget, rid: str, accepted_of_4: int, times: int = 60) -> None:
    for _ in range(times):
        budget.observe(rid, 4, accepted_of_4)


def test_memory_bound_step_takes_every_likely_draft():
    budget = AdaptiveBudget(4, FLAT)
    assert budget.choose({"a": 4}, base_tokens=1) == {"a": 4}


def test_compute_bound_large_batch_takes_none():
    budget = AdaptiveBudget(4, LINEAR)
    offered = {f"r{i}": 4 for i in range(64)}
    assert set(budget.choose(offered, base_tokens=64).values()) == {0}


def test_estimates_follow_observations_and_separate_requests():
    budget = AdaptiveBudget(4, [(1, 0.010), (8, 0.012), (64, 0.030)])
    _learned(budget, "copying", 4)  # every draft accepted
    _learned(budget, "chatting", 0)  # every first draft rejected
    assert budget.acceptance("copying")[3] > 0.9 and budget.acceptance("chatting")[0] < 0.1
    chosen = budget.choose({"copying": 4, "chatting": 4}, base_tokens=2)
    assert chosen["copying"] == 4 and chosen["chatting"] == 0
    budget.forget("copying")
    assert budget.acceptance("copying") == budget.shared.rates  # back to the shared estimate


def test_step_time_interpolates_and_extrapolates():
    budget = AdaptiveBudget(2, LINEAR)
    assert abs(budget.step_time(32) - 0.032) < 1e-9
    assert abs(budget.step_time(1024) - 1.024) < 1e-9


def test_no_drafts_when_plain_decodes_run_a_cheaper_path():
    """Verification steps cost double plain decode steps of the same size: drafts must survive to pay."""
    verify = [(1, 0.010), (64, 0.020), (512, 0.080)]
    decode = [(1, 0.005), (64, 0.010), (512, 0.040)]
    budget = AdaptiveBudget(4, verify, decode)
    assert set(budget.choose({f"r{i}": 4 for i in range(16)}, base_tokens=16).values()) == {0}
    _learned(budget, "copying", 4)
    assert budget.choose({"copying": 4}, base_tokens=1) == {"copying": 4}  # near-certain drafts still pay


def test_a_skipped_request_is_probed_now_and_then():
    budget = AdaptiveBudget(4, LINEAR)
    offered = {f"r{i}": 4 for i in range(64)}
    rounds = [budget.choose(offered, base_tokens=64) for _ in range(16)]
    assert all(set(r.values()) == {0} for r in rounds[:15])
    assert set(rounds[15].values()) == {1}  # one draft each after 16 skipped steps, then quiet again
    assert set(budget.choose(offered, base_tokens=64).values()) == {0}


def test_confidences_rank_draft_prefixes_across_requests():
    """Confidence-scheduled verification: in a step where only likely drafts pay, the drafter's own
    per-token confidences decide which requests' prefixes are verified, and how far."""
    budget = AdaptiveBudget(4, [(1, 0.011), (64, 0.074)])  # 10 ms + 1 ms per token: a draft must be likely
    offered = {"sure": 4, "unsure": 4, "middling": 4}
    confidences = {"sure": [0.99, 0.98, 0.97, 0.2], "unsure": [0.1, 0.1, 0.1, 0.1], "middling": [0.9, 0.3, 0.9, 0.9]}
    chosen = budget.choose(offered, base_tokens=3, confidences=confidences)
    assert chosen == {"sure": 3, "unsure": 0, "middling": 1}
