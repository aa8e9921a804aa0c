"""vLLM's sleep mode on the CPU (`enable_sleep_mode`, `LLM.sleep` / `wake_up` / `is_sleeping`): level 1 frees
the KV cache and keeps the weights (host memory is where they live), level 2 frees the weights too and reloads
them from the checkpoint; greedy output after waking is the output before sleeping. Without the flag, a sleep is
refused."""
from __future__ import annotations

import gc
import weakref

import pytest
from conftest import random_prompts

from pressroom import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(3, low=20, high=40, seed=5)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _worker(llm: LLM):
    return llm.engine.core.executor.driver_worker


def _freed(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


@pytest.fixture(scope="module")
def sleepy(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, enable_sleep_mode=True)
    yield llm
    llm.shutdown()


def test_level_1_frees_the_kv_cache_keeps_the_weights_and_wakes_to_the_same_output(sleepy):
    before = _tokens(sleepy)
    worker = _worker(sleepy)
    caches = [weakref.ref(t) for t in worker.model_runner.kv_caches]
    cache_bytes = sum(t.untyped_storage().nbytes() for t in worker.model_runner.kv_caches)
    weights = [weakref.ref(p) for p in worker.model.parameters()]
    assert caches and cache_bytes > 0
    assert not sleepy.is_sleeping()

    sleepy.sleep(level=1)
    assert sleepy.is_sleeping()
    assert _freed(caches)  # the cache tensors are gone, their memory with them
    assert worker.model_runner.kv_caches == [] and not _freed(weights)  # the weights stay in host memory
    assert sleepy.engine.core.stats().sleep_level == 1 and sleepy.engine.core.kv_cache.usage() == 0
    with pytest.raises(RuntimeError, match="call wake_up"):
        sleepy.generate(PROMPTS[0], GREEDY, use_tqdm=False)

    sleepy.wake_up()
    assert not sleepy.is_sleeping() and sleepy.engine.core.stats().sleep_level == 0
    woken = worker.model_runner.kv_caches
    assert sum(t.untyped_storage().nbytes() for t in woken) == cache_bytes
    outs = sleepy.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == before
    # the prefix cache was emptied with the KV it indexed: the prompts seen before sleeping are computed again
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert sleepy.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens >= 16


def test_level_2_drops_the_weights_and_reloads_them_on_waking(sleepy):
    before = _tokens(sleepy)
    worker = _worker(sleepy)
    weights = [weakref.ref(p) for p in worker.model.parameters()]
    caches = [weakref.ref(t) for t in worker.model_runner.kv_caches]

    sleepy.sleep(level=2)
    assert sleepy.is_sleeping() and sleepy.engine.core.stats().sleep_level == 2
    assert worker.model is None and _freed(weights) and _freed(caches)

    sleepy.wake_up(tags=["weights"])  # vLLM's step-wise wake: weights first, still asleep
    assert sleepy.is_sleeping() and worker.model is not None and worker.model_runner.kv_caches == []
    sleepy.wake_up(tags=["kv_cache"])
    assert not sleepy.is_sleeping() and worker.model_runner.kv_caches
    assert _tokens(sleepy) == before


def test_sleep_arguments_are_checked(sleepy):
    with pytest.raises(ValueError, match="level must be 0, 1 or 2"):
        sleepy.sleep(level=3)
    with pytest.raises(ValueError, match="Invalid pause mode"):
        sleepy.sleep(mode="later")
    sleepy.sleep(level=0)  # a pause: memory untouched, generation refused until wake_up
    assert sleepy.is_sleeping() and _worker(sleepy).model_runner.kv_caches
    with pytest.raises(ValueError, match="Unknown wake_up tag"):
        sleepy.wake_up(tags=["weight"])
    sleepy.wake_up(tags=["scheduling"])
    assert not sleepy.is_sleeping()


def test_sleep_without_the_flag_is_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)
    with pytest.raises(ValueError, match="Sleep mode is not enabled.*--enable-sleep-mode"):
        llm.sleep()
    with pytest.raises(ValueError, match="Sleep mode is not enabled"):
        llm.wake_up()
    assert llm.is_sleeping() is False
    llm.shutdown()
