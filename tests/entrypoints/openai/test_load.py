"""Load and disconnects on the embedded model: a real `pressroom serve` subprocess on loopback.

Bounded count and time: 256 concurrent short streams, then 50 streaming clients that go away mid-generation
(half close their connection after the first chunk, half are SIGKILLed with their sockets open), then 2,000 short
requests (on the tiny llama) with the API process's RSS read before and after. Every KV block must come back, as
/metrics reports, and the server must keep serving. (Faults under load, the core SIGKILLed and the server
SIGTERMed with streams open: test_faults_under_load.py.)
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import psutil
import pytest
from serving import pid_serving

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server  # the embedded SmolLM2, the CPU's 256 sequences (shared: conftest.py)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_drained(url: str, seconds: float) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a KV block; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        m = _metrics(url)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "num_requests" in k or "kv_cache" in k}
        time.sleep(0.1)


def _still_serves(url: str, model: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Still there?", "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


@pytest.mark.slow
def test_256_concurrent_streams_complete_without_leaks(server, model):
    """With test-slow: a scale test (8.5 s of a clean-clone CI run's default suite, 60 s beside other work); the
    default suite keeps test_server.py's 128 concurrent streams on the tiny llama, each complete, no block leaked."""
    n, max_tokens = 256, 8
    peak = {"running": 0.0}

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(model=model, prompt=f"Request {i}: the weather today is",
                                                 max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        usage, finish = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return usage.completion_tokens, finish

    async def watch(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                text = (await http.get(f"{server}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running{"):
                        peak["running"] = max(peak["running"], float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.05)

    async def main():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            try:
                return await asyncio.gather(*[one(client, i) for i in range(n)])
            finally:
                stop.set()
                await watcher

    start = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - start
    assert results == [(max_tokens, "length")] * n  # all complete, no errors
    assert peak["running"] > 32, peak  # they really ran together (max_num_seqs is 256)
    m = _wait_drained(server, 10)  # no leaked blocks
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    assert elapsed < 90, elapsed
    _still_serves(server, model)


# A child process holding streams open until it is SIGKILLed: the kernel closes its sockets, no goodbye.
_KILLED_CLIENT = textwrap.dedent("""
    import asyncio, sys, httpx
    url, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    async def hold(i, got):
        body = {"model": model, "prompt": f"Killed client {i} writes", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        client = httpx.AsyncClient(timeout=60)
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    got.release()
                    await asyncio.sleep(3600)
    async def main():
        got = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(hold(i, got)) for i in range(n)]
        for _ in range(n):
            await got.acquire()
        print("ready", flush=True)
        await asyncio.gather(*tasks)
    asyncio.run(main())
""")


def test_50_killed_streaming_clients_return_every_block(server, model):
    n_closed, n_killed = 25, 25
    _wait_drained(server, 10)
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, server, model, str(n_killed)],
                              stdout=subprocess.PIPE, text=True)
    try:
        async def main():
            clients = [httpx.AsyncClient(timeout=60) for _ in range(n_closed)]  # one connection each
            streams = []
            try:
                async def open_one(i: int):
                    body = {"model": model, "prompt": f"Closed client {i} writes", "max_tokens": 1500,
                            "ignore_eos": True, "stream": True}
                    cm = clients[i].stream("POST", f"{server}/v1/completions", json=body)
                    r = await cm.__aenter__()
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    async for line in lines:
                        if line.startswith("data:"):
                            break  # the first chunk: generation is under way
                    streams.append((cm, lines))  # both kept: a dropped line iterator would close the stream now

                await asyncio.gather(*[open_one(i) for i in range(n_closed)])
                ready = await asyncio.wait_for(asyncio.to_thread(killed.stdout.readline), 60)
                assert ready.strip() == "ready"
                async with httpx.AsyncClient(timeout=10) as http:
                    from prometheus_client.parser import text_string_to_metric_families
                    text = (await http.get(f"{server}/metrics")).text
                    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                # all 50 are in the engine mid-generation, holding blocks
                in_engine = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
                assert in_engine == n_closed + n_killed, m
                assert m["vllm:kv_cache_usage_perc"] > 0, m
                os.kill(killed.pid, signal.SIGKILL)
                for cm, lines in streams:  # closed after the first chunk: the connection goes, mid-stream
                    await lines.aclose()
                    await cm.__aexit__(None, None, None)
            finally:
                for c in clients:
                    await c.aclose()

        start = time.monotonic()
        asyncio.run(main())
        killed.wait(10)
        # 50 x 1500 tokens would take minutes; aborted, every block is back within seconds
        m = _wait_drained(server, 10)
        assert time.monotonic() - start < 60
        assert m["vllm:kv_cache_usage_perc"] == 0
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    _still_serves(server, model)



SHORT_REQUESTS = 2000
WARM_UP = 200  # first-use costs (the routes' code paths, the tokenizer's caches, the allocator's arenas) come first
CONCURRENCY = 32
# What 2,000 requests may leave behind in the API process: a leak of 100 KB a request (a request's state, its
# detokenizer or its output kept past its end) would be 200 MB and fail; what stays after the warm-up (the
# allocator keeping freed pages, the metrics' histograms) is some tens of MB.
MAX_RSS_GROWTH = 100 << 20


def _short_request(i: int, model: str) -> tuple[str, dict]:
    """Every third a completion, a chat completion, a tokenization; each prompt its own (no prefix shared)."""
    kind = i % 3
    if kind == 0:
        return "/v1/completions", {"model": model, "prompt": f"Short request {i}:", "max_tokens": 2}
    if kind == 1:
        return "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": f"Short request {i}"}]}
    return "/tokenize", {"model": model, "prompt": f"Short request {i} to tokenize"}


def _send_all(url: str, model: str, first: int, count: int) -> list[int]:
    """Sends requests first..first+count-1, CONCURRENCY at a time; their statuses."""
    async def main() -> list[int]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=CONCURRENCY)) as http:
            async def one(i: int) -> int:
                path, body = _short_request(i, model)
                async with gate:
                    return (await http.post(path, json=body)).status_code
            return await asyncio.gather(*[one(i) for i in range(first, first + count)])
    return asyncio.run(main())


@pytest.mark.slow  # 84 s on a busy 2-core machine (load average 10): the 2,000 requests took 74 s
@pytest.mark.timeout(600)
def test_2000_short_requests_leave_the_api_process_its_memory(tiny_server):
    """On the tiny llama (its server shared: conftest.py), whose steps cost little next to the API's own work per
    request, which is what is measured here. Measured: 2,000 in 74 s, the API's RSS 392 MiB -> 393 MiB."""
    server, model = tiny_server, "tiny"
    process = psutil.Process(pid_serving(server))
    assert set(_send_all(server, model, 0, WARM_UP)) == {200}
    _wait_drained(server, 10)
    before = process.memory_info().rss
    started = time.monotonic()
    statuses = _send_all(server, model, WARM_UP, SHORT_REQUESTS)
    elapsed = time.monotonic() - started
    assert statuses == [200] * SHORT_REQUESTS, {s: statuses.count(s) for s in set(statuses)}
    m = _wait_drained(server, 10)
    assert m["vllm:kv_cache_usage_perc"] == 0
    after = process.memory_info().rss
    print(f"{SHORT_REQUESTS} short requests in {elapsed:.1f} s; API RSS {before >> 20} MiB -> {after >> 20} MiB")
    assert after - before < MAX_RSS_GROWTH, (before >> 20, after >> 20)
    _still_serves(server, model)
