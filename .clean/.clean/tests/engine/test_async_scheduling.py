"""Async scheduling (step N+1 scheduled while step N's tokens are still on their way) changes no output.

The CPU has nothing to overlap, but the bookkeeping is the same as on CUDA: placeholders in the
scheduler, the previous step's sampled tokens as the next step's inputs, results one step late.
"""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, LLMEngine, SamplingParams
from pressroom.config import EngineArgs


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def _run(path: str, prompts, params, **engine) -> list[list[int]]:
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.kv_cache.usage() == 0.0  # every block back
    return [list(o.outputs[0].token_ids) for o in outs]


def _both(path: str, prompts, params, **engine) -> tuple[list[list[int]], list[list[int]]]:
    return (_run(path, prompts, params, async_scheduling=False, **engine),
            _run(path, prompts, params, async_scheduling=True, **engine))


def test_greedy_mixed_lengths_chunked_prefill_and_prefix_cache(tiny_llama):
    shared = random_prompts(1, low=50, high=51, seed=2)[0]
    prompts = random_prompts(12, low=3, high=90, seed=1) + [shared + p for p in random_prompts(6, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    sync, async_ = _both(tiny_llama, prompts, params, max_num_batched_tokens=48)
    assert async_ == sync
    assert [len(t) for t in async_] == [5 + 3 * i for i in range(len(prompts))]  # max_tokens never overshoots


def test_stop_tokens_end_requests_at_the_same_token(tiny_llama):
    prompts = random_prompts(8, seed=4)
    free_run = _run(tiny_llama, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stops = [t[7] for t in free_run]  # each request's 8th token becomes one of the stop tokens
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops, ignore_eos=True)
    sync, async_ = _both(tiny_llama, prompts, params)
    assert async_ == sync
    assert all(len(t) <= 8 and t[-1] in stops for t in async_)


def test_preemption_and_n_siblings(tiny_llama):
    prompts = random_prompts(24, low=20, high=60, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sync, async_ = _both(tiny_llama, prompts, params, num_gpu_blocks_override=40)
    assert async_ == sync
    n_params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    llm_sync = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, async_scheduling=False)
    llm_async = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, async_scheduling=True)
    a = llm_sync.generate([{"prompt_token_ids": prompts[0]}], n_params, use_tqdm=False)[0]
    b = llm_async.generate([{"prompt_token_ids": prompts[0]}], n_params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_features_that_read_history_run_in_step_and_agree(tiny_llama):
    """Seeds, penalties, min_tokens and logprobs make a step wait for the previous one's tokens."""
    prompts = random_prompts(6, seed=6)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             min_tokens=3, logprobs=2) for i in range(6)]
    sync, async_ = _both(tiny_llama, prompts, params)
    assert async_ == sync


def test_unseeded_sampling_and_abort_in_flight(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.05,
                                                   async_scheduling=True))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, seed=8)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, int] = {}
    for _ in range(6):
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    engine.abort_request(["r0", "r1"])  # while a step holding their tokens is in flight
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"r2": 50, "r3": 50} and seen
    engine.step()  # drains the step still in flight for the finished requests
    assert engine.kv_cache.usage() == 0.0
