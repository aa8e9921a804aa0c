"""The adaptive speculative budget: every likely draft when a step is memory-bound, none when it is
compute-bound and the batch is large, and estimates that follow what verification observes."""
from __future__ import annotations

import math
import random

import numpy as np

from pressroom.core.spec_budget import _OWN_PRIOR, AdaptiveBudget, _arrays, _interp

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
    assert budget.acceptance("copying")[3] > 0.9 and budget.acceptance("chatting")[0] < 0.15
    chosen = budget.choose({"copying": 4, "chatting": 4}, base_tokens=2)
    assert chosen["copying"] == 4 and chosen["chatting"] == 0
    budget.forget("copying")
    assert budget.acceptance("copying") == budget.shared.optimistic  # back to the shared estimate


def test_each_request_blends_its_own_estimate_with_the_shared_one_by_what_it_saw():
    """Rows of one batch: a request with no history plans with the shared (optimistic) estimate; one with
    history weighs its own moving average by how often each position was observed."""
    budget = AdaptiveBudget(3, [(1, 0.010), (8, 0.012)])
    budget.observe("seen", 3, 1)  # first accepted, second rejected, third unobserved
    budget.observe("seen", 3, 3)
    shared = np.array(budget.shared.optimistic)
    own = budget.own["seen"]
    rows = budget._acceptance_matrix(["new", "seen", "other"])
    seen = np.array(own.seen, dtype=float)
    blended = (seen * np.array(own.rates) + _OWN_PRIOR * shared) / (seen + _OWN_PRIOR)
    assert np.allclose(rows[0], shared) and np.allclose(rows[2], shared)
    assert np.allclose(rows[1], blended) and list(own.seen) == [2, 2, 1]


def test_step_time_interpolates_and_extrapolates():
    budget = AdaptiveBudget(2, LINEAR)
    assert abs(budget.step_time(32) - 0.032) < 1e-9
    assert abs(budget.step_time(1024) - 1.024) < 1e-9


def test_no_drafts_when_plain_decodes_run_a_cheaper_path():
    """Verification steps cost double plain decode steps of the same size: drafts must survive to pay."""
    verify = [(1, 0.010), (64, 0.020), (512, 0.080)]
    decode = [(1, 0.005), (64, 0.010), (512, 0.040)]
    budget = AdaptiveBudget(4, verify, decode)
    budget.shared.assume([0.7] * 4)
    assert set(budget.choose({f"r{i}": 4 for i in range(16)}, base_tokens=16).values()) == {0}
    _learned(budget, "copying", 4)
    assert budget.choose({"copying": 4}, base_tokens=1) == {"copying": 4}  # near-certain drafts still pay


def test_a_position_that_stops_being_drafted_is_not_stuck_at_a_low_guess():
    """Shared estimates are decayed counts with an optimistic bonus: a position whose estimate fell below
    what pays stops being drafted, its counts fade with every step, and its bonus grows until the plan
    drafts it again and learns its true rate (an average that only moves on observations stays low)."""
    budget = _knowing(RATES, draft_costs=[(1, 0.0014), (256, 0.0018)])
    budget.shared.trials[1], budget.shared.hits[1] = 50.0, 20.0  # an unlucky run: 0.4 where 0.75 is true
    allowed = {f"r{i}": 7 for i in range(64)}
    planned = budget.plan(allowed, base_tokens=64)
    assert max(planned.values()) <= 1  # the second position looks too weak to draft
    for _ in range(300):  # steps without a second-position draft: its counts fade
        budget.tick()
    assert min(budget.plan(allowed, base_tokens=64).values()) >= 2  # tried again
    rng = random.Random(0)
    for _ in range(200):
        budget.observe("r0", 2, 2 if rng.random() < 0.75 else 1)
    assert abs(budget.shared.rates[1] - 0.75) < 0.1


def test_a_skipped_request_is_probed_now_and_then():
    """16 skipped steps, then one draft; each probe that did not pay doubles the wait; in a batch of 64
    requests (4 x 16) every wait is 4 times as long, so the batch probes about as often as one of 16."""
    for rows in (16, 64):
        budget = AdaptiveBudget(4, LINEAR)
        offered = {f"r{i}": 4 for i in range(rows)}
        crowding = rows // 16
        for wait in (16, 32):
            rounds = [budget.choose(offered, base_tokens=64) for _ in range(wait * crowding)]
            assert all(set(r.values()) == {0} for r in rounds[:-1])
            assert set(rounds[-1].values()) == {1}


def test_confidences_rank_draft_prefixes_across_requests():
    """Confidence-scheduled verification: in a step where only likely drafts pay, the drafter's own
    per-token confidences decide which requests' prefixes are verified, and how far."""
    budget = AdaptiveBudget(4, [(1, 0.011), (64, 0.074)])  # 10 ms + 1 ms per token: a draft must be likely
    offered = {"sure": 4, "unsure": 4, "middling": 4}
    confidences = {"sure": [0.99, 0.98, 0.97, 0.2], "unsure": [0.1, 0.1, 0.1, 0.1], "middling": [0.9, 0.3, 0.9, 0.9]}
    chosen = budget.choose(offered, base_tokens=3, confidences=confidences)
    assert chosen == {"sure": 3, "unsure": 0, "middling": 1}


# ---- plan: how many drafts to make, before drafting (a draft model pays one forward pass per position) ----

RATES = [0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.25]  # a real drafter's decay, as the H200 benchmark uses
VERIFY = [(1, 0.007), (256, 0.010), (2048, 0.040)]  # memory-bound up to ~256 tokens, then compute-bound


def _knowing(rates: list[float], **curves) -> AdaptiveBudget:
    budget = AdaptiveBudget(len(rates), curves.pop("verify", VERIFY), **curves)
    budget.shared.assume(rates)  # as if learned
    return budget


def _fixed_k_rate(budget: AdaptiveBudget, k: int, n: int, draft: list[tuple[int, float]]) -> float:
    """Tokens per second of n requests all drafting and verifying k: the same cost model, written out."""
    survival = sum(math.prod(RATES[:j + 1]) for j in range(k))
    seconds = budget.step_time(n * (1 + k)) + k * (budget.step_time(n, draft) if k else 0.0)
    return n * (1 + survival) / seconds


def test_plan_at_batch_one_is_the_best_fixed_k_counting_the_draft_steps():
    draft = [(1, 0.002), (256, 0.003)]  # a small model's step: a good part of the target's 7 ms
    budget = _knowing(RATES, draft_costs=draft)
    best = max(range(8), key=lambda k: _fixed_k_rate(budget, k, 1, draft))
    assert 1 < best < 7  # the draft steps make the last, unlikely drafts not worth making
    assert budget.plan({"a": 7}, base_tokens=1) == {"a": best}
    assert _knowing(RATES).plan({"a": 7}, base_tokens=1) == {"a": 7}  # free drafting: every draft pays


def test_plan_makes_no_drafts_at_high_concurrency_when_they_do_not_pay():
    draft = [(1, 0.003), (256, 0.006)]
    budget = _knowing(RATES, verify=LINEAR, draft_costs=draft)
    planned = budget.plan({f"r{i}": 7 for i in range(256)}, base_tokens=256)
    assert set(planned.values()) == {0}  # the draft model can skip its steps altogether


def test_plan_opens_a_draft_position_for_every_request_or_none():
    """Verification almost free (memory-bound), a draft step 4 ms whatever its rows: one request's draft
    never pays for a draft step, 256 requests' drafts do. The best uniform depth is chosen."""
    flat, draft = [(1, 0.010), (4096, 0.010)], [(1, 0.004), (256, 0.004)]
    budget = _knowing(RATES, verify=flat, draft_costs=draft)
    assert budget.plan({"a": 7}, base_tokens=256) == {"a": 0}
    n = 256
    best = max(range(8), key=lambda k: n * (1 + sum(math.prod(RATES[:j + 1]) for j in range(k))) / (0.010 + 0.004 * k))
    assert best == 2
    assert set(budget.plan({f"r{i}": 7 for i in range(n)}, base_tokens=n).values()) == {best}


def test_plan_respects_each_requests_allowance():
    budget = _knowing(RATES, verify=[(1, 0.010), (4096, 0.010)])  # every draft pays, up to what is allowed
    assert budget.plan({"a": 7, "near_its_end": 2, "done": 0}, base_tokens=3) == {"a": 7, "near_its_end": 2, "done": 0}


def test_a_request_planned_no_drafts_is_probed_and_the_probe_verified():
    budget = _knowing(RATES, verify=LINEAR, draft_costs=[(1, 0.003), (256, 0.006)])
    allowed = {f"r{i}": 7 for i in range(16)}
    rounds = [budget.plan(allowed, base_tokens=64) for _ in range(16)]
    assert all(set(r.values()) == {0} for r in rounds[:15])
    assert set(rounds[15].values()) == {1}  # one draft each is made...
    offered = dict.fromkeys(allowed, 1)
    assert set(budget.choose(offered, base_tokens=64).values()) == {1}  # ...and verified, though it does not pay
    assert set(budget.plan(allowed, base_tokens=64).values()) == {0}  # then quiet again


def test_the_vectorized_curve_agrees_with_step_time():
    budget = AdaptiveBudget(2, VERIFY)
    points = np.array([1, 100, 256, 1000, 4096])  # inside, on the knots, and extrapolated past the end
    assert np.allclose(_interp(_arrays(VERIFY), points), [budget.step_time(int(n)) for n in points])


def test_overconfident_drafter_is_calibrated_by_what_survives():
    """A drafter that says 0.95 at every position while only its first draft survives, a third of the
    time: its confidences are scaled down to what verification sees, so fewer drafts are verified."""
    curve = [(1, 0.010), (2, 0.011), (4, 0.016), (8, 0.030)]  # a verified draft costs a good part of a step
    budget = AdaptiveBudget(4, curve)
    says = [0.95] * 4
    assert budget.choose({"a": 4}, base_tokens=1, confidences={"a": says}) == {"a": 4}  # taken at its word
    rng = np.random.default_rng(0)
    for _ in range(200):
        budget.observe("a", 4, int(rng.random() < 1 / 3), says)
    scaled = budget.calibrated(says)
    assert abs(scaled[0] - 1 / 3) < 0.15 and scaled[1] < 0.1
    assert budget.choose({"a": 4}, base_tokens=1, confidences={"a": says})["a"] <= 1


def test_a_backlog_that_cannot_join_does_not_shrink_the_drafts():
    """Running requests fill max_num_seqs: waiting prompts cannot join this step, so the budget prices
    only the running decodes and keeps their drafts (it used to count every waiting prompt)."""
    from pressroom import SamplingParams
    from pressroom.config import SchedulerConfig
    from pressroom.core.kv_cache_manager import KVCacheManager
    from pressroom.core.request import Request
    from pressroom.core.scheduler import Scheduler

    def drafts_kept(waiting: int) -> int:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=2, max_model_len=4096),
                          KVCacheManager(512, 16, enable_caching=False),
                          # Memory-bound up to 64 tokens, compute-bound past it: drafts pay only in a small step.
                          spec_budget=AdaptiveBudget(4, [(1, 0.010), (64, 0.010), (512, 0.512)]))
        params = SamplingParams(temperature=0, max_tokens=100)
        for i in range(2 + waiting):
            sched.add_request(Request(f"r{i}", [1] * (8 if i < 2 else 1000), params, None))
        sched.schedule()  # admits r0, r1 (their prompts); the rest wait behind max_num_seqs
        for req in sched.running:
            req.output_token_ids.append(2)  # their first tokens came back
            req.num_output_placeholders = 0
            req.spec_token_ids = [3, 3, 3, 3]
        for rid in ("r0", "r1"):
            _learned(sched.spec_budget, rid, 4)  # drafts that always survive
        return sum(len(d) for d in sched.schedule().scheduled_spec_decode_tokens.values())

    assert drafts_kept(0) > 0
    assert drafts_kept(3) == drafts_kept(0)


def test_a_block_pass_that_costs_more_than_its_drafts_earn_is_not_run():
    """plan prices a block drafter's shared pass on a request's first position: drafts that would pay
    for their verification and slots are still dropped when the pass itself costs more."""
    verify = [(1, 0.010), (2, 0.0102), (8, 0.011)]  # memory-bound: verifying is nearly free
    slot = [(1, 0.0001), (64, 0.0064)]  # scoring one more slot: cheap
    for block, planned in (([(1, 0.0001), (64, 0.001)], True), ([(1, 0.008), (64, 0.05)], False)):
        budget = AdaptiveBudget(4, verify, draft_costs=slot, block_costs=block)
        budget.shared.assume([0.5, 0.3, 0.2, 0.1])  # conditional acceptance per position
        got = budget.plan({"a": 4}, base_tokens=1)["a"]
        assert (got > 0) == planned, (block, got)


def test_plan_stops_drafting_what_choose_keeps_dropping():
    """Verified drafts teach the estimates, dropped ones do not: a drafter whose confidences make `choose`
    drop every draft would look worth running for ever. `plan` counts the planned drafts `choose` kept, so it
    stops planning them, and plans again once those counts have faded."""
    slot, block = [(1, 0.0005), (64, 0.004)], [(1, 0.001), (64, 0.008)]
    budget = AdaptiveBudget(4, [(1, 0.010), (2, 0.0105), (8, 0.012)], draft_costs=slot, block_costs=block)
    budget.shared.assume([0.8, 0.7, 0.6, 0.5])  # what the verified (confident) drafts showed
    assert budget.plan({"a": 4}, base_tokens=1)["a"] > 0
    for _ in range(40):  # the drafter says 0.05 every time: nothing is worth verifying
        planned = budget.plan({"a": 4}, base_tokens=1)["a"]
        if planned == 0:
            break
        assert budget.choose({"a": planned}, base_tokens=1, confidences={"a": [0.05] * planned}) == {"a": 0}
        budget.tick()
    assert planned == 0 and budget.kept.trials[0] > 0
    assert "a" not in budget.planned
    for _ in range(600):  # steps without planned drafts (the request's probes aside): the counts fade
        budget.tick()
    assert budget.plan({"a": 4}, base_tokens=1)["a"] > 0


def test_plan_follows_measured_step_times_where_they_depart_from_the_curves():
    """Profiled once at start-up, the curves can flatter speculation (a busy machine then, or time a step
    spends outside the model); synchronous steps report their wall time, and `plan` scales plain and
    speculative steps by what they took against the curves."""
    slot, block = [(1, 0.0005), (64, 0.004)], [(1, 0.001), (64, 0.008)]
    verify, decode = [(1, 0.010), (2, 0.0105), (8, 0.012)], [(1, 0.010), (8, 0.012)]

    def budget() -> AdaptiveBudget:
        b = AdaptiveBudget(4, verify, decode, draft_costs=slot, block_costs=block)
        b.shared.assume([0.8, 0.7, 0.6, 0.5])
        return b

    assert budget().plan({"a": 4}, base_tokens=1)["a"] > 0
    slow = budget()
    drafting = {"a": 2}
    expected = slow.expected_seconds(3, True, drafting, 0)
    assert abs(expected - (0.01075 + 2 * 0.0005 + 0.001)) < 1e-9  # verify 3 tokens, two slots of one row, the block
    for _ in range(100):  # speculative steps take three times the curves, plain ones what the curves say
        slow.observe_step(3 * expected, 3, True, drafting, 0)
        slow.observe_step(slow.expected_seconds(1, False, {}, 0), 1, False, {}, 0)
    assert slow.log_slowdown[0] == 0.0 and abs(slow.log_slowdown[1] - math.log(3)) < 0.01
    assert slow.plan({"a": 4}, base_tokens=1)["a"] == 0


def test_a_new_request_inherits_the_probe_backoff_until_drafts_pay_again():
    """Short requests would each start probing after 16 steps: a stream of them where drafts never pay
    keeps the longest wait reached, until some request's drafts are chosen on their merit."""
    budget = AdaptiveBudget(4, [(1, 0.010), (64, 0.012), (128, 0.140), (512, 0.600)])  # compute-bound past 64
    for wait in (16, 32):
        rounds = [budget.choose({"old": 4}, base_tokens=128) for _ in range(wait)]
        assert rounds[-1] == {"old": 1} and all(r == {"old": 0} for r in rounds[:-1])
    budget.forget("old")
    rounds = [budget.choose({"new": 4}, base_tokens=128) for _ in range(64)]
    assert all(r == {"new": 0} for r in rounds[:-1]) and rounds[-1] == {"new": 1}  # waits 64, not 16
    assert budget.choose({"sure": 4}, base_tokens=1)["sure"] > 0  # memory-bound: drafts pay on their merit
    assert budget.first_wait == 16
