"""The scheduler's figures behind vLLM's /metrics families: waiting requests split by why they wait
(num_requests_waiting_by_reason), tokens per step in vLLM's buckets (iteration_tokens_total), and a request's
preemptions carried on its outputs (request_num_preemptions)."""
from __future__ import annotations

from concurrent.futures import Future

from pressroom.config import SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import ITERATION_TOKENS_BUCKETS, Scheduler
from pressroom.sampling_params import SamplingParams

STREAM = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)


def _scheduler(max_num_seqs: int = 8, num_blocks: int = 256) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=max_num_seqs,
                             prefill_cost_context=0, long_prefill_token_threshold=0)
    return Scheduler(config, KVCacheManager(num_blocks, 16, enable_caching=False))


def _step(sched: Scheduler) -> list:
    """One step, token 7 sampled for every request that reached its end; the core's outputs."""
    out = sched.schedule()
    sampled = {rid: [7] for rid in out.num_scheduled_tokens
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    return sched.update_from_output(out, ModelRunnerOutput(sampled))


def test_waiting_requests_are_split_into_capacity_and_deferred():
    """As vLLM's: a request counts as deferred when its last admission pass skipped it for something passing
    (here its grammar compiling); one no pass reached, the batch being full, waits for room."""
    sched = _scheduler(max_num_seqs=2)
    compiling: Future = Future()
    sched.add_request(Request("grammar", [3] * 8, STREAM, None, grammar=compiling))  # skipped: compiling
    sched.add_request(Request("a", [1] * 8, STREAM, None))
    sched.add_request(Request("b", [1] * 8, SamplingParams(max_tokens=2, ignore_eos=True), None))
    _step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_deferred) == (2, 1, 1)
    sched.add_request(Request("no-room", [2] * 8, STREAM, None))  # the batch is full: it waits for room
    compiling.set_result(None)
    _step(sched)  # "b" ends with this step's token; the batch was full, so no pass looked at the waiting
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_deferred) == (1, 2, 1)
    _step(sched)  # a slot: the compiled grammar's request is admitted (it arrived first)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_deferred) == (2, 1, 0)
    assert "grammar" in {r.request_id for r in sched.running}


def test_steps_are_counted_in_vllms_iteration_token_buckets():
    sched = _scheduler()
    sched.add_request(Request("a", [1] * 20, STREAM, None))
    sched.add_request(Request("b", [2] * 100, STREAM, None))
    for _ in range(4):  # the prompts (120 tokens), then three decode steps of 2 tokens
        _step(sched)
    stats = sched.stats()
    expected = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    expected[ITERATION_TOKENS_BUCKETS.index(128)] = 1  # 120 <= 128
    expected[ITERATION_TOKENS_BUCKETS.index(8)] = 3  # 2 <= 8
    assert stats.iteration_tokens == expected and stats.iteration_tokens_sum == 120 + 3 * 2
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    sched.schedule()  # nothing to run: no step
    assert sum(sched.stats().iteration_tokens) == 4


def test_a_preempted_requests_outputs_carry_its_preemptions():
    sched = _scheduler(num_blocks=6)  # 96 slots: two requests growing past 48 tokens each cannot both stay
    sched.add_request(Request("first", [1] * 30, SamplingParams(max_tokens=40, ignore_eos=True), None))
    sched.add_request(Request("second", [2] * 30, SamplingParams(max_tokens=50, ignore_eos=True), None))
    seen: dict[str, int] = {}
    for _ in range(100):
        for out in _step(sched):
            seen[out.req_id] = out.num_preemptions
    assert sched.num_preemptions >= 1
    assert not sched.requests  # both finished, the second resumed after the first ended
    assert seen == {"first": 0, "second": 1}  # the later arrival was the victim, once
