"""Fan-out fairness: a request of n = 128 (or a list of prompts) is many requests of one group; among equal
priorities, a request whose group runs fewer goes first, so a single request arriving behind a large group
runs within a step or two, while the group still completes in its own order."""
from __future__ import annotations

import pytest
from test_scheduler import _step

from pressroom import LLMEngine, SamplingParams
from pressroom.config import EngineArgs, SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.request import Request
from pressroom.core.scheduler import Scheduler


def _scheduler(max_num_seqs: int, budget: int = 512, policy: str = "fcfs", blocks: int = 2048) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=4096,
                             policy=policy)
    return Scheduler(config, KVCacheManager(blocks, 16, enable_caching=True))


def _fan_out(sched: Scheduler, name: str, n: int, max_tokens: int, arrival: float, priority: int = 0,
             prompt_len: int = 40) -> list[Request]:
    """A request of n samples as the engine hands it over: the first computes the prompt, the rest follow it."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    lead = None
    children = []
    for i in range(n):
        req = Request(f"{name}{i}", list(range(prompt_len)), params, None, arrival, priority, follows=lead)
        sched.add_request(req)
        children.append(req)
        lead = lead or req
    return children


def _single(sched: Scheduler, name: str, arrival: float, priority: int = 0, max_tokens: int = 4) -> Request:
    req = Request(name, [9] * 30, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), None,
                  arrival, priority)
    sched.add_request(req)
    return req


def test_a_group_is_its_parent_request():
    lead = Request("a", [1], SamplingParams(), None)
    assert lead.group == "a" and Request("b", [1], SamplingParams(), None, follows=lead).group == "a"
    assert Request("c", [1], SamplingParams(), None, group="cmpl-1").group == "cmpl-1"


def test_a_single_request_behind_128_samples_runs_within_two_steps_and_the_group_completes():
    sched = _scheduler(max_num_seqs=32)
    group = _fan_out(sched, "g", 128, max_tokens=50, arrival=0.0)
    started: list[str] = []
    for _ in range(3):  # the group takes every slot
        started += [rid for rid in _step(sched) if rid not in started]
    assert len(sched.running) == 32
    single = _single(sched, "single", arrival=1.0)
    steps_to_start = next(i for i in range(1, 3) if "single" in _step(sched))
    assert steps_to_start <= 2 and single.num_computed_tokens >= 30
    # one sibling gave its slot (only one: a group of one is never preempted for the group's sake)
    assert sched.num_preemptions == 1 and len(sched.running) == 32
    restarts = []
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step = _step(sched)
        restarts += [rid for rid in step if rid in started and sched.requests.get(rid) is not None
                     and step[rid] > 1]  # its prompt again: the sibling that gave its slot
        started += [rid for rid in step if rid not in started]
    assert all(r.status.finished for r in group + [single])
    assert all(r.num_output_tokens == 50 for r in group) and single.num_output_tokens == 4
    # the group ran in its own order, and the sibling that gave its slot went back to its place (the first)
    assert [rid for rid in started if rid != "single"] == [f"g{i}" for i in range(128)]
    assert restarts == ["g31"]


def test_a_later_single_prompt_goes_before_a_prompt_lists_next_prompts():
    """Admission limited by the step's budget, not by slots: a 100-prompt request gets 4 prompts a step; a
    single request arriving meanwhile is admitted in the next step, not after the whole list."""
    sched = _scheduler(max_num_seqs=256, budget=256)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(100):
        sched.add_request(Request(f"p{i}", [i] * 64, params, None, 0.0, group="cmpl-list"))
    _step(sched)
    _single(sched, "single", arrival=1.0)
    step = _step(sched)
    assert "single" in step
    assert sum(1 for rid in step if rid.startswith("p")) > 0  # the list keeps its share of the step
    assert sched.num_preemptions == 0  # slots to spare: nobody gives one up


def test_two_large_groups_converge_to_equal_shares_without_trading_slots_back():
    sched = _scheduler(max_num_seqs=32)
    _fan_out(sched, "a", 64, max_tokens=1000, arrival=0.0)
    for _ in range(3):
        _step(sched)
    _fan_out(sched, "b", 64, max_tokens=1000, arrival=1.0)
    for _ in range(40):
        _step(sched)
    counts = {g: sum(1 for r in sched.running if r.group == g) for g in ("a0", "b0")}
    assert counts == {"a0": 16, "b0": 16}
    assert sched.num_preemptions == 16  # each move narrowed the gap; none went back


def test_priority_still_comes_first():
    sched = _scheduler(max_num_seqs=8, policy="priority")
    _fan_out(sched, "urgent", 16, max_tokens=20, arrival=0.0, priority=0)
    for _ in range(3):
        _step(sched)
    # a less urgent single request takes no slot from a more urgent group, however large
    _single(sched, "later", arrival=1.0, priority=5)
    for _ in range(3):
        assert "later" not in _step(sched)
    assert sched.num_preemptions == 0
    # and a more urgent single one waits for a free slot (no preemption for priority, as before), then goes first
    sched = _scheduler(max_num_seqs=8, policy="priority")
    _fan_out(sched, "g", 16, max_tokens=5, arrival=0.0, priority=5)
    for _ in range(3):
        _step(sched)
    _single(sched, "urgent", arrival=1.0, priority=0)
    steps = [_step(sched)]
    while "urgent" not in steps[-1]:
        steps.append(_step(sched))
        assert not steps[-2].keys() - {f"g{i}" for i in range(8)}  # meanwhile: the first 8 samples only
    assert next(iter(steps[-1])) == "urgent"  # the first admitted to the first free slots
    assert sched.num_preemptions == 0
    # a group gives a slot to a newcomer of its own priority, even where a less urgent request runs too
    sched = _scheduler(max_num_seqs=8, policy="priority")
    _single(sched, "low", arrival=0.0, priority=9, max_tokens=100)
    _step(sched)
    _fan_out(sched, "g", 16, max_tokens=100, arrival=1.0, priority=0)
    for _ in range(3):
        _step(sched)
    _single(sched, "new", arrival=2.0, priority=0)
    assert "new" in _step(sched)
    assert sched.num_preemptions == 1 and sched.requests["g6"].status.name == "PREEMPTED"
    assert {r.request_id for r in sched.running} == {"low", "new"} | {f"g{i}" for i in range(6)}


def test_running_out_of_blocks_preempts_the_largest_groups_latest_sibling_first():
    sched = _scheduler(max_num_seqs=64)
    _fan_out(sched, "g", 6, max_tokens=100, arrival=0.0)
    _single(sched, "late", arrival=1.0, max_tokens=100)
    for _ in range(4):
        _step(sched)
    assert [r.request_id for r in sched.running] == ["g0", "late", "g1", "g2", "g3", "g4", "g5"]
    assert sched.running[-1].request_id == "g5"  # the victim if blocks ran out now


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def _run(engine: LLMEngine) -> tuple[dict, list[str]]:
    done, order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                order.append(out.request_id)
    return done, order


def test_fan_out_fairness_keeps_greedy_outputs(tiny_llama):
    """n = 8 over 4 slots, a single request arriving once 4 samples run: it takes a sibling's slot at once,
    and every output is the greedy one it has alone."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.05,
                                                   max_num_seqs=4))
    prompt, other = [5, 17, 99, 3, 250, 41, 7, 7, 64, 12], [300, 2, 2, 18, 77, 150]
    expected = []
    for rid, p in (("alone-0", prompt), ("alone-1", other)):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
        expected.append(_run(engine)[0][rid].outputs[0].token_ids)
    engine.add_request("group", {"prompt_token_ids": prompt}, params.clone(n=8))
    engine.step()
    engine.step()  # the first 4 samples run
    engine.add_request("single", {"prompt_token_ids": other}, params)
    done, order = _run(engine)
    assert order == ["single", "group"]
    assert engine.stats().num_preemptions >= 1
    assert [c.token_ids for c in done["group"].outputs] == [expected[0]] * 8
    assert done["single"].outputs[0].token_ids == expected[1]


def test_a_prompt_lists_prompts_are_one_group(tiny_llama):
    """8 prompts of one client's request (`group`) over 4 slots, a single request arriving once 4 of them run: it
    takes a slot of the list's at once, and every output is the greedy one it has alone."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.05,
                                                   max_num_seqs=4))
    prompts = [[5 + i, 17, 99, 3, 250, 41, 7, 7, 64, 12] for i in range(9)]
    expected = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"alone-{i}", {"prompt_token_ids": p}, params)
        expected[i] = _run(engine)[0][f"alone-{i}"].outputs[0].token_ids
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"cmpl-1-{i}", {"prompt_token_ids": p}, params, group="cmpl-1")
    engine.step()  # the first 4 prompts run
    engine.add_request("single", {"prompt_token_ids": prompts[8]}, params)
    done, order = _run(engine)
    assert order.index("single") < 4  # before the list's prompts that had not run when it came
    assert engine.stats().num_preemptions == 1
    assert [done[f"cmpl-1-{i}"].outputs[0].token_ids for i in range(8)] == [expected[i] for i in range(8)]
    assert done["single"].outputs[0].token_ids == expected[8]
