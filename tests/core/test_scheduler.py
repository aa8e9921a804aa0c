"""Prefill chunks on the CPU's defaults: a long prompt gets at most long_prefill_token_threshold of a step, counted
as cost (tokens x (1 + context / prefill_cost_context)), so its later chunks shrink while decodes keep their
token each step; and it still progresses every step."""
from __future__ import annotations

import torch

from pressroom.config import CPU_PREFILL_COST_CONTEXT, CPU_TOKENS_PER_THREAD, EngineArgs, SchedulerConfig
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.outputs import ModelRunnerOutput
from pressroom.core.request import Request
from pressroom.core.scheduler import Scheduler
from pressroom.sampling_params import SamplingParams

STREAM = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _scheduler(budget: int, cost_context: int, threshold: int = 0, caching: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=8192, prefill_cost_context=cost_context,
                             long_prefill_token_threshold=threshold)
    return Scheduler(config, KVCacheManager(2048, 16, enable_caching=caching))


def _step(sched: Scheduler) -> dict[str, int]:
    """One scheduled step, its tokens sampled (token 7) for every request that reached its end."""
    out = sched.schedule()
    sampled = {rid: [7] for rid in out.num_scheduled_tokens
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out.num_scheduled_tokens


def _prefill_long_prompt(sched: Scheduler, streams: int, prompt_len: int = 8000) -> list[dict[str, int]]:
    """`streams` short requests decoding, then a long prompt: each step until its prompt is computed."""
    for i in range(streams):
        sched.add_request(Request(f"s{i}", [1] * 20, STREAM, None))
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        _step(sched)  # their prompts
    sched.add_request(Request("long", list(range(prompt_len)), ONE, None))
    steps = []
    while "long" in sched.requests and sched.requests["long"].num_computed_tokens < prompt_len:
        steps.append(_step(sched))
        assert len(steps) < 5000
    return steps


def test_a_long_prompts_chunks_shrink_as_its_context_grows_while_decodes_keep_their_pace():
    for k, budget, threshold in ((2048, 512, 0), (2048, 512, 256)):
        steps = _prefill_long_prompt(_scheduler(budget, k, threshold), streams=4)
        limit = min(budget - 4, threshold or budget)
        chunks, context = [], 0
        for step in steps:
            # every stream gets its token in every step, and the prompt progresses in every step
            assert all(step.get(f"s{i}") == 1 for i in range(4)), step
            assert step["long"] > 0
            # the chunk's cost at its context stays within what the step leaves it
            n = step["long"]
            assert n * (1 + context / k) <= limit + 1
            chunks.append(n)
            context += n
        assert sum(chunks) == 8000
        assert chunks[0] == limit  # no context yet: tokens alone
        assert all(a >= b for a, b in zip(chunks, chunks[1:-1]))  # non-increasing (the last is the remainder)
        assert chunks[-2] < chunks[0] / 3  # at ~7,500 tokens of context: 1 + 7500/2048 = 4.7x the cost per token

    # Cost-based chunking off (CUDA's default): tokens count alone, every chunk as large as the budget allows.
    plain = _prefill_long_prompt(_scheduler(budget, 0), streams=4)
    assert [s["long"] for s in plain[:-1]] == [budget - 4] * (len(plain) - 1)
    assert len(steps) > len(plain)


def test_a_prompt_alone_is_prefilled_with_progress_every_step():
    # the second: past 960 tokens of context, even one token costs more than the budget
    for budget, k, threshold, prompt_len in ((512, CPU_PREFILL_COST_CONTEXT, 256, 8000), (16, 64, 0, 2000)):
        steps = _prefill_long_prompt(_scheduler(budget, k, threshold), streams=0, prompt_len=prompt_len)
        assert all(s["long"] >= 1 for s in steps)
        assert sum(s["long"] for s in steps) == prompt_len
    # decodes fill most of the budget: the prompt still gets a chunk every step, and every stream its token
    steps = _prefill_long_prompt(_scheduler(64, 128), streams=60, prompt_len=400)
    assert all(s["long"] >= 1 and len(s) == 61 for s in steps)


def test_a_prefix_cache_hit_is_the_context_of_the_first_chunk():
    k, budget = 1024, 512
    sched = _scheduler(budget, k, threshold=budget, caching=True)
    prompt = list(range(4000))
    sched.add_request(Request("first", prompt, ONE, None))
    while "first" in sched.requests:
        _step(sched)
    sched.add_request(Request("again", prompt[:3072] + [9] * 928, ONE, None))
    first_chunk = _step(sched)["again"]
    assert first_chunk == budget * k // (k + 3072)  # 3,072 cached tokens before it


def test_a_short_prompt_joins_while_a_long_one_is_prefilled():
    """The threshold leaves the rest of the step to others: a short prompt arriving behind the long one is
    computed in the next step, not after the whole long prompt."""
    sched = _scheduler(512, 2048, threshold=256)
    sched.add_request(Request("long", list(range(8000)), ONE, None))
    _step(sched)
    sched.add_request(Request("short", [5] * 100, ONE, None))
    step = _step(sched)
    assert step["short"] == 100 and 0 < step["long"] < 256
    # without a threshold the long prompt takes every step's whole budget, and the short one waits
    sched = _scheduler(512, 2048)
    sched.add_request(Request("long", list(range(8000)), ONE, None))
    _step(sched)
    sched.add_request(Request("short", [5] * 100, ONE, None))
    assert "short" not in _step(sched)


def test_only_the_cpu_defaults_to_cost_based_chunks():
    assert SchedulerConfig().prefill_cost_context == 0 and SchedulerConfig().long_prefill_token_threshold == 0
    cpu = EngineArgs(device="cpu").create_engine_config().scheduler
    assert cpu.prefill_cost_context == CPU_PREFILL_COST_CONTEXT
    assert cpu.long_prefill_token_threshold == CPU_TOKENS_PER_THREAD * torch.get_num_threads()
    off = EngineArgs(device="cpu", prefill_cost_context=0, long_prefill_token_threshold=0).create_engine_config()
    assert off.scheduler.prefill_cost_context == 0 and off.scheduler.long_prefill_token_threshold == 0
    # CUDA keeps vLLM's defaults; where there is no GPU, only the resolution is checked
    assert EngineArgs()._prefill_chunking("cuda", threads=1) == {"long_prefill_token_threshold": 0,
                                                                 "prefill_cost_context": 0}


def test_suspects_of_a_failed_step_run_alone_taking_turns_with_the_others():
    """Each suspect is recomputed (prompt and outputs) alone until it samples; the others run in between."""
    sched = _scheduler(512, 0)
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, [1] * 20, STREAM, None))
    _step(sched)
    _step(sched)  # each has 2 outputs: 22 tokens
    sched.suspect(["b", "a"])  # a step of a and b failed
    steps = [_step(sched) for _ in range(4)]
    assert steps == [{"a": 22}, {"a": 1, "c": 1}, {"b": 22}, {"a": 1, "b": 1, "c": 1}]
    assert not sched.suspects and sched.num_preemptions == 2
    assert [r.num_output_tokens for r in sched.requests.values()] == [5, 4, 4]  # outputs kept, none repeated
