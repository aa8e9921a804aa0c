"""Pooling requests in the scheduler: prefill-only requests that share each step's token budget with generation,
are chunked like any prompt (a decoder's) or wait for a step with room for the whole prompt (an encoder's), never
take prefix-cache hits, and finish with their vector, freeing their blocks."""
from __future__ import annotations

from pressroom.config import SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput
from pressroom.core.request import Request, RequestStatus
from pressroom.core.scheduler import Scheduler
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams

STREAM = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
POOL = SamplingParams(temperature=0, max_tokens=1)
MEAN = PoolingParams("MEAN", True)


def _scheduler(budget: int = 64, caching: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=4096, prefill_cost_context=0,
                             long_prefill_token_threshold=0)
    return Scheduler(config, KVCacheManager(512, 16, enable_caching=caching))


def _run_step(sched: Scheduler, pooled: set[str] = frozenset()):
    """One step: every request that reached its end samples token 7; the ids in `pooled` get a vector."""
    out = sched.schedule()
    sampled, vectors = {}, {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        if req.pooling is not None:
            if done and rid in pooled:
                vectors[rid] = [1.0, 0.0]
        elif done:
            sampled[rid] = [7]
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled, pooled=vectors))


def test_a_pooling_prompt_is_chunked_beside_running_decodes_within_one_budget():
    sched = _scheduler(budget=64)
    for i in range(4):
        sched.add_request(Request(f"s{i}", [1] * 8, STREAM, None))
    _run_step(sched)  # their prompts
    sched.add_request(Request("emb", list(range(200)), POOL, None, pooling=MEAN))
    steps, results = [], []
    while "emb" in sched.requests:
        out, res = _run_step(sched, pooled={"emb"})
        steps.append(out.num_scheduled_tokens)
        results += res
        assert out.total_num_scheduled_tokens <= 64
        assert all(out.num_scheduled_tokens[f"s{i}"] == 1 for i in range(4))  # decodes keep their token each step
    assert [s["emb"] for s in steps] == [60, 60, 60, 20]  # the budget's leftover, step after step
    (final,) = [r for r in results if r.req_id == "emb"]
    assert final.pooled == [1.0, 0.0] and final.finish_reason == "stop" and final.new_token_ids == []
    assert "emb" not in sched.kv.req_blocks  # its blocks went back with its vector


def test_an_encoder_prompt_waits_for_a_step_with_room_for_all_of_it():
    sched = _scheduler(budget=64)
    for i in range(10):
        sched.add_request(Request(f"s{i}", [1] * 8, STREAM, None))
    _run_step(sched)  # 10 decodes now take 10 tokens of each step's 64
    sched.add_request(Request("enc", [5] * 60, POOL, None, pooling=MEAN, whole_prompt=True))
    out, _ = _run_step(sched)
    assert "enc" not in out.num_scheduled_tokens  # 54 tokens are left; the prompt needs 60 in one step
    sched.finish_requests([f"s{i}" for i in range(6)], RequestStatus.FINISHED_ABORTED)  # 4 decodes: 60 left
    out, results = _run_step(sched, pooled={"enc"})
    assert out.num_scheduled_tokens["enc"] == 60 and [r.pooled for r in results if r.req_id == "enc"] == [[1.0, 0.0]]


def test_pooling_requests_take_no_prefix_cache_hits():
    sched = _scheduler(budget=256, caching=True)
    prompt = list(range(100))
    sched.add_request(Request("gen", prompt, POOL, None))
    _run_step(sched)
    sched.add_request(Request("emb", prompt, POOL, None, pooling=MEAN))
    out, _ = _run_step(sched, pooled={"emb"})
    assert out.num_scheduled_tokens["emb"] == 100  # every prompt token's hidden state is pooled
    assert out.new_requests[0].num_computed_tokens == 0 and out.new_requests[0].pooling == MEAN
