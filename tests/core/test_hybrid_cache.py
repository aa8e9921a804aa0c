"""The hybrid cache's bookkeeping: one budget shared by KV blocks and state slots, live slots taken and freed
with a request's blocks, prefix checkpoints reserved at block boundaries, findable only after their step, cut
back to the longest held boundary, and dropped with their blocks."""
from __future__ import annotations

import pytest

from pressroom.core.cache_plan import default_checkpoint_interval, plan_cache
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.request import Request
from pressroom.core.state_pool import StatePool
from pressroom.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None)


def test_the_plan_shares_one_budget_between_blocks_states_and_checkpoints():
    kv, state = 1000, 3000
    interval = default_checkpoint_interval(kv, state, BS)
    assert interval == 3 * BS  # the checkpoint's bytes equal its tokens' KV bytes
    plan = plan_cache(1_000_000, kv, state, BS, interval, max_num_seqs=8, caching=True,
                      bookkeeping_blocks=0, max_model_len=BS)
    used = plan.num_blocks * kv + (plan.num_live_slots + plan.num_checkpoints) * state
    assert plan.num_live_slots == 8 and 1_000_000 - state <= used <= 1_000_000
    # checkpoints cover about the tokens the blocks hold
    assert plan.num_checkpoints == pytest.approx(plan.num_blocks * BS / interval, abs=2)
    off = plan_cache(1_000_000, kv, state, BS, interval, max_num_seqs=8, caching=False,
                     bookkeeping_blocks=0, max_model_len=BS)
    assert off.num_checkpoints == 0 and off.num_blocks == (1_000_000 - 8 * state) // kv


def test_a_state_larger_than_the_budget_is_refused_and_a_small_budget_limits_concurrency():
    with pytest.raises(ValueError, match="holds no request"):
        plan_cache(5000, 1000, 4000, BS, BS, max_num_seqs=8, caching=True,
                   bookkeeping_blocks=0, max_model_len=BS)
    plan = plan_cache(20_000, 1000, 4000, BS, BS, max_num_seqs=8, caching=False,
                      bookkeeping_blocks=0, max_model_len=BS)
    assert plan.num_live_slots == 3  # (20000 - 2 blocks) // (4000 + one block of KV)
    attention_free = plan_cache(100_000, 0, 4000, BS, 256, max_num_seqs=8, caching=True,
                                bookkeeping_blocks=77, max_model_len=BS)
    assert (attention_free.num_blocks, attention_free.num_live_slots, attention_free.num_checkpoints) == (77, 8, 17)


def test_live_slots_leave_each_the_kv_of_a_whole_request():
    """A large state (Nemotron-H-8B: 102 MB a request, 16 KB of KV a token) and a large max_num_seqs: slots for
    every request the budget's KV can also hold at max_model_len, not a budget of states with no room for blocks."""
    kv, state, budget, max_len = 16384 * BS, 102_137_856, 45 << 30, 384
    plan = plan_cache(budget, kv, state, BS, 6240, max_num_seqs=512, caching=False, bookkeeping_blocks=0,
                      max_model_len=max_len)
    assert plan.num_live_slots == (budget - 2 * kv) // (state + max_len // BS * kv) < 512
    assert (plan.num_blocks - 1) * BS >= plan.num_live_slots * max_len  # every live request can reach max_model_len
    short = plan_cache(budget, kv, state, BS, 6240, max_num_seqs=8, caching=False, bookkeeping_blocks=0,
                       max_model_len=max_len)
    assert short.num_live_slots == 8  # max_num_seqs still caps them


def _manager(num_live: int = 2, num_checkpoints: int = 4, num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, None, StatePool(num_live, num_checkpoints), checkpoint_interval=2 * BS)


def _admit(kv: KVCacheManager, req: Request, n: int | None = None) -> tuple[int, int, int]:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, (n or req.num_tokens) - num_hit, hits)
    req.num_computed_tokens = num_hit
    return (num_hit, *kv.state_slots(req.request_id))


def test_live_slots_bound_admission_and_come_back_on_free():
    kv = _manager(num_live=2)
    a, b, c = (_request(x, list(range(10, 15))) for x in "abc")
    assert _admit(kv, a)[1] != _admit(kv, b)[1]
    hits, num_hit = kv.get_computed_blocks(c)
    assert not kv.allocate_slots(c, 5, hits)  # no live slot left: nothing changes
    assert "c" not in kv.req_blocks or not kv.req_blocks["c"]
    kv.free(a)
    assert _admit(kv, c)[1] in (1, 2)


def test_checkpoints_are_planned_at_boundaries_and_restored_after_their_step():
    kv = _manager()
    prompt = list(range(100, 121))  # 21 tokens: boundaries at 8 and 16
    first = _request("a", prompt)
    num_hit, live, restore = _admit(kv, first)
    assert (num_hit, restore) == (0, -1)
    saves = kv.take_state_saves()
    assert [offset for offset, _ in saves["a"]] == [8, 16]
    second = _request("b", prompt[:18] + [7, 7])
    assert kv.get_computed_blocks(second)[1] == 0  # the writing step is not back yet
    kv.checkpoints_done(saves)
    num_hit, live_b, restore = _admit(kv, second)
    assert num_hit == 16 and restore == saves["a"][1][1] and live_b != live
    assert kv.take_state_saves() == {}  # boundary 16 is held already; 20 is not in the prompt's full blocks


def test_a_prefix_hit_ends_at_the_longest_held_checkpoint():
    kv = _manager()
    prompt = list(range(200, 221))
    _admit(kv, _request("a", prompt))
    saves = kv.take_state_saves()
    kv.checkpoints_done(saves)
    kv.states.drop(kv._hashes(_request("x", prompt), 4)[-1])  # the checkpoint at 16 is gone
    assert _admit(kv, _request("b", prompt))[:3:2] == (8, saves["a"][0][1])


def test_a_failed_step_gives_its_checkpoints_back_and_an_evicted_block_drops_its_checkpoint():
    kv = _manager(num_blocks=12)
    prompt = list(range(300, 317))
    a = _request("a", prompt)
    _admit(kv, a)
    saves = kv.take_state_saves()
    kv.checkpoints_done(saves, ok=False)
    assert kv.get_computed_blocks(_request("b", prompt))[1] == 0
    assert len(kv.states.free_checkpoints) == 4
    kv.free(a)
    c = _request("c", prompt)
    _admit(kv, c)
    kv.checkpoints_done(kv.take_state_saves())
    kv.free(c)
    assert len(kv.states.checkpoints) == 2
    filler = _request("f", [900, 901, 902])  # room for 40 tokens takes every free block: the cached ones go
    assert kv.allocate_slots(filler, 40) and kv.take_state_saves() == {}
    assert not kv.states.checkpoints and len(kv.states.free_checkpoints) == 4
    assert kv.get_computed_blocks(_request("d", prompt))[1] == 0


def test_checkpoint_slots_are_reused_least_recently_used_first():
    pool = StatePool(1, 2)
    for h in (b"a", b"b"):
        pool.reserve(h)
    pool.commit([b"a", b"b"])
    assert pool.lookup(b"a") is not None  # a is now the most recently used
    slot_b = pool.checkpoints[b"b"]
    assert pool.reserve(b"c") == slot_b and not pool.has(b"b") and pool.lookup(b"c") is None
    pool.reserve(b"d")  # a is evicted
    assert pool.reserve(b"e") is None  # every slot is reserved by steps in flight
