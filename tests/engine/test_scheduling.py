"""Continuous batching, chunked prefill, prefix caching and preemption never change greedy outputs."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pressroom import LLM, LLMEngine, SamplingParams
from pressroom.config import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_batch_of_32_chunked_equals_alone_embedded():
    prompts = random_prompts(32, low=3, high=150, seed=7)
    alone_llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1)
    alone = [_tokens(alone_llm.generate(_token_prompts([p]), GREEDY, use_tqdm=False))[0] for p in prompts]
    batched_llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gib=0.1, max_num_batched_tokens=64)
    batched = _tokens(batched_llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False))
    assert batched == alone


def test_prefix_cache_computes_only_uncached_tokens(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.05))
    computed = [0]
    run = engine.runner.execute_model

    def counting(sched):
        computed[0] += sched.total_num_scheduled_tokens
        return run(sched)

    engine.runner.execute_model = counting
    prefix = random_prompts(1, low=1000, high=1001, seed=3)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]

    def finish(rid, prompt):
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        return outs[0]

    finish("a", first)
    computed[0] = 0
    queries, hits = engine.kv_cache.stats.queries, engine.kv_cache.stats.hits
    warm = finish("b", second)
    cached = (1000 // 16) * 16  # full blocks of the shared prefix
    assert engine.kv_cache.stats.hits - hits == cached
    assert engine.kv_cache.stats.queries - queries == len(second)
    assert warm.num_cached_tokens == cached
    # prompt tokens computed = uncached ones; then one token per generated token but the last
    assert computed[0] == len(second) - cached + GREEDY.max_tokens - 1

    cold = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    assert _tokens(cold.generate(_token_prompts([second]), GREEDY, use_tqdm=False))[0] == warm.outputs[0].token_ids


def test_preemption_under_small_kv_pool_keeps_outputs(tiny_llama):
    prompts = random_prompts(64, low=10, high=60, seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05)
    expected = _tokens(roomy.generate(_token_prompts(prompts), params, use_tqdm=False))
    # 64 requests need about 64 * 5 blocks at once; 48 blocks force preemption.
    tight = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=48)
    got = _tokens(tight.generate(_token_prompts(prompts), params, use_tqdm=False))
    assert tight.engine.stats().num_preemptions > 0
    assert got == expected
    assert tight.engine.kv_cache.pool.num_free_blocks == 48


def test_n_samples_share_the_prompt_blocks(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05)
    prompt = random_prompts(1, low=200, high=201, seed=5)[0]
    out = llm.generate(_token_prompts([prompt]), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    # the three followers found the leader's full prompt blocks in the prefix cache
    assert llm.engine.kv_cache.stats.hits == 3 * (200 // 16) * 16


def test_abort_frees_blocks_and_others_continue(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.05))
    free_at_start = engine.kv_cache.pool.num_free_blocks
    prompts = random_prompts(3, low=30, high=60, seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("1")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"0", "2"}
    assert engine.kv_cache.pool.num_free_blocks == free_at_start
    ref = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05)
    expected = _tokens(ref.generate(_token_prompts([prompts[0], prompts[2]]), GREEDY, use_tqdm=False))
    assert [done["0"].outputs[0].token_ids, done["2"].outputs[0].token_ids] == expected


def test_priority_admits_better_priority_first(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    prompts = random_prompts(3, seed=13)
    for rid, (p, prio) in zip("abc", zip(prompts, [5, 9, 0])):
        engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=3), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["c", "a", "b"]


def test_equal_length_prompts_batched_in_one_attention_call_match_alone(tiny_llama):
    prompts = random_prompts(6, low=37, high=38, seed=21)  # all 37 tokens: the batched prefill path
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_gib=0.05, enable_prefix_caching=False)
    together = _tokens(llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False))
    alone = [_tokens(llm.generate(_token_prompts([p]), GREEDY, use_tqdm=False))[0] for p in prompts]
    assert together == alone
