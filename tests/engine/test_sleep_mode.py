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


def test_the_async_engine_refuses_sleep_without_the_flag(tiny_async_engine):
    import asyncio
    with pytest.raises(ValueError, match="Sleep mode is not enabled"):
        asyncio.run(tiny_async_engine.sleep(1))
    assert asyncio.run(tiny_async_engine.is_sleeping()) is False


@pytest.mark.slow
def test_server_routes_sleep_and_wake_the_engine_core_process(tiny_model_dir):
    """Slow: an engine core process of its own (sleep mode on) behind a loopback server, some 20 s on 2 cores.
    vLLM's dev-mode routes: POST /sleep?level=N&mode=M, POST /wake_up[?tags=...], GET /is_sleeping. A request in
    flight when the engine falls asleep ends with finish_reason "abort" (mode=wait: it finishes first; keep: it
    resumes after waking, to the same text); requests sent while asleep wait for wake_up; /metrics'
    engine_sleep_state follows; the greedy output after waking is the one before."""
    import os
    import threading
    import time
    from unittest import mock

    import httpx
    import uvicorn

    from pressroom import EngineArgs
    from pressroom.engine.async_engine import AsyncLLMEngine
    from pressroom.entrypoints.openai.server import DEV_MODE_ENV, bind_listener, build_app
    from pressroom.entrypoints.openai.settings import ServerSettings

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), dtype="float32",
                                                        kv_cache_memory_gib=0.05, enable_sleep_mode=True))
    settings = ServerSettings(served_model_name=("tiny",), log_requests=False, log_stats_interval=0)
    with mock.patch.dict(os.environ, {DEV_MODE_ENV: "1"}):
        app = build_app(engine, settings)
    sock = bind_listener("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        body = {"model": "tiny", "prompt": [7, 8, 9, 10, 11], "max_tokens": 6, "temperature": 0, "ignore_eos": True}

        def complete() -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        def sleep_state() -> dict[str, float]:
            text = httpx.get(f"{url}/metrics").text
            return {s: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:engine_sleep_state{") for s in ("awake", "weights_offloaded",
                                                                               "discard_all") if f'"{s}"' in line}

        before = complete().json()["choices"][0]["text"]
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert sleep_state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}

        # a long request in flight is aborted by the sleep (vLLM's default mode)
        long = dict(body, max_tokens=2000)
        result: list[httpx.Response] = []
        runner = threading.Thread(target=lambda: result.append(
            httpx.post(f"{url}/v1/completions", json=long, timeout=120)))
        runner.start()
        time.sleep(1.0)
        assert httpx.post(f"{url}/sleep", params={"level": "1"}, timeout=60).status_code == 200
        runner.join(60)
        assert result[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"] == "abort"
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        assert sleep_state() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}

        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert complete().json()["choices"][0]["text"] == before

        assert httpx.post(f"{url}/sleep", params={"level": "2"}, timeout=60).status_code == 200
        assert sleep_state() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
        # a request sent while asleep waits for wake_up (vLLM queues it), then runs on the reloaded weights
        waiting: list[httpx.Response] = []
        queued = threading.Thread(target=lambda: waiting.append(complete()))
        queued.start()
        time.sleep(0.5)
        assert not waiting
        assert httpx.post(f"{url}/wake_up", params=[("tags", "weights")], timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still asleep
        assert httpx.post(f"{url}/wake_up", params=[("tags", "kv_cache")], timeout=60).status_code == 200
        queued.join(60)
        assert waiting[0].json()["choices"][0]["text"] == before

        # mode=wait: answered once the request in flight is done (it ends by its length); one sent meanwhile is
        # held, and served after wake_up
        result.clear()
        waiting.clear()
        runner = threading.Thread(target=lambda: result.append(
            httpx.post(f"{url}/v1/completions", json=dict(body, max_tokens=400), timeout=120)))
        runner.start()
        time.sleep(0.3)
        slept: list[httpx.Response] = []
        sleeper = threading.Thread(target=lambda: slept.append(
            httpx.post(f"{url}/sleep", params={"level": "1", "mode": "wait"}, timeout=120)))
        sleeper.start()
        time.sleep(0.2)
        queued = threading.Thread(target=lambda: waiting.append(complete()))
        queued.start()
        sleeper.join(120)
        runner.join(120)
        assert slept[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        time.sleep(0.3)
        assert not waiting
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        queued.join(60)
        assert waiting[0].json()["choices"][0]["text"] == before

        # mode=keep: the request in flight is kept, recomputed after wake_up, and ends as it would have
        keep = dict(body, max_tokens=200)
        reference = httpx.post(f"{url}/v1/completions", json=keep, timeout=120).json()["choices"][0]["text"]
        result.clear()
        runner = threading.Thread(target=lambda: result.append(
            httpx.post(f"{url}/v1/completions", json=keep, timeout=120)))
        runner.start()
        time.sleep(0.3)
        assert httpx.post(f"{url}/sleep", params={"level": "1", "mode": "keep"}, timeout=60).status_code == 200
        time.sleep(0.3)
        assert not result
        assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
        runner.join(60)
        kept = result[0].json()["choices"][0]
        assert (kept["finish_reason"], kept["text"]) == ("length", reference)

        bad = httpx.post(f"{url}/sleep", params={"level": "5"})
        assert bad.status_code == 400 and "level must be 0, 1 or 2" in bad.json()["error"]["message"]
        bad = httpx.post(f"{url}/wake_up", params={"tags": "everything"})
        assert bad.status_code == 400 and "Unknown wake_up tag" in bad.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.shutdown()


@pytest.mark.slow
def test_every_rank_sleeps_under_the_multiprocess_executor(tiny_model_dir):
    """Slow: two tensor-parallel worker processes (some 15 s on 2 cores). Sleep and wake_up reach every rank
    through collective_rpc: each frees its KV cache shard and, at level 2, reloads its weight shard."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05, enable_sleep_mode=True,
              tensor_parallel_size=2)
    try:
        executor = llm.engine.core.executor
        before = _tokens(llm)
        awake = executor.collective_rpc("sleep_state")
        assert len(awake) == 2 and all(tags == [] and held > 0 for tags, held in awake)
        for level in (1, 2):
            llm.sleep(level=level)
            assert executor.collective_rpc("sleep_state") == [(["kv_cache", "weights"], 0)] * 2
            llm.wake_up()
            assert executor.collective_rpc("sleep_state") == awake
            assert _tokens(llm) == before
    finally:
        llm.shutdown()
