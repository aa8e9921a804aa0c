"""`pressroom serve` end to end: a real server subprocess on loopback, driven by the official openai client."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from conftest import tiny_args
from serving import serve

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the tiny llama, requests up to 1 MiB (shared: conftest.py)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _aclient(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """Made inside the event loop that uses it (and closed there)."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def _metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    text = httpx.get(f"{url}/metrics", headers=headers).text
    totals: dict[str, float] = {}  # each name's samples summed over their labels (finish reasons, engines)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def _labelled(url: str, api_key: str, name: str, **labels: str) -> float:
    """One labelled sample of /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _wait_idle(url: str, seconds: float) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        m = _metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


# ---- small endpoints ----

def test_models_health_version_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json()["version"]
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


# ---- completions ----

def test_completion_with_logprobs_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert len(choice.logprobs.tokens) == 5 == len(choice.logprobs.token_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_batch_with_n(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Good morning"], max_tokens=4, n=2, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    r2 = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, temperature=0,
                                   logprobs=1)
    lp = r2.choices[0].logprobs
    assert r2.choices[0].text.startswith("Hello world") and "".join(lp.tokens) == r2.choices[0].text
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])


def test_streamed_completion_equals_unstreamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, seed=7, temperature=1.0, n=2)
    whole = client.completions.create(**kwargs)
    texts, usage = ["", ""], None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert usage.completion_tokens == whole.usage.completion_tokens == 24


def test_stop_string_cuts_text(client):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    expected = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == expected


# ---- chat ----

def test_chat_with_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=3, seed=1)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6 == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content


def test_async_chat_streamed_equals_unstreamed(server):
    asyncio.run(_async_chat_streamed_equals_unstreamed(server))


async def _async_chat_streamed_equals_unstreamed(server):
    async with _aclient(server) as aclient:
        await _chat_streamed_equals_unstreamed(aclient)


async def _chat_streamed_equals_unstreamed(aclient):
    kwargs = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Tell me a story"}],
                  max_tokens=10, seed=11, n=2)
    whole = await aclient.chat.completions.create(**kwargs)
    texts, roles, usage = ["", ""], set(), None
    stream = await aclient.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert "assistant" in roles and usage.completion_tokens == 20 == whole.usage.completion_tokens


# ---- bad input ----

BAD = [
    (b"{not json", 400),
    (b'["a list"]', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400),
    (b'{"model": "tiny", "prompt": "x", "temperature": -0.5}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400),
    (b'{"model": "tiny", "prompt": 12}', 400),
    (b'{"model": "tiny", "prompt": "x", "n": 100000}', 400),
    (b'{"model": "tiny", "prompt": ["x", "y", "z", "w", "v", "u", "t", "s", "r"], "n": 128}', 400),
    (b'{"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400),
    (b'{"model": "tiny", "prompt": [100000000]}', 400),
    (b'{"model": "nope", "prompt": "x"}', 404),
]


def test_bad_requests_get_json_errors_while_a_stream_completes(server):
    async def main():
        async with _aclient(server) as aclient:
            await _bad_requests_while_a_stream_completes(server, aclient)
    asyncio.run(main())


async def _bad_requests_while_a_stream_completes(server, aclient):
    stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=40, stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True})
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        huge = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'  # 10 MB
        long_prompt = {"model": MODEL, "prompt": "hello " * 5000, "max_tokens": 1}
        for body, status in BAD + [(huge, 413)]:
            r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:80], r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"]


        async def chunked():  # no content-length: the limit is enforced while reading
            for i in range(0, len(huge), 1 << 20):
                yield huge[i:i + (1 << 20)]
        r = await http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await http.post("/v1/completions", json=long_prompt)
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
        assert r.status_code == 400
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": image})
        assert r.status_code == 400 and "(image_url)" in r.json()["error"]["message"]  # "x" is no media URL
        for header in ("X-Priority", "X-Vllm-Priority"):
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={header: "hi"})
            assert r.status_code == 400 and r.json()["error"]["param"] == header
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Priority": "-3"})
        assert r.status_code == 200
    with pytest.raises(openai.BadRequestError):
        await aclient.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        await aclient.completions.create(model="missing", prompt="x")
    finish, usage = None, None
    async for chunk in stream:
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        usage = chunk.usage or usage
    assert finish == "length" and usage.completion_tokens == 40


# ---- disconnects ----

async def _open_and_drop(server: str, n_chunks: int) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= n_chunks:
                    break


def test_metrics_move_as_requests_run(server, client):
    before = _wait_idle(server, 10)
    client.completions.create(model=MODEL, prompt="Count me", max_tokens=4, extra_body={"ignore_eos": True})
    after = _wait_idle(server, 10)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:time_to_first_token_seconds_count"] == \
        before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:e2e_request_latency_seconds_count"] == \
        before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] >= \
        before["vllm:inter_token_latency_seconds_count"] + 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:request_queue_time_seconds_count"] == \
        before["vllm:request_queue_time_seconds_count"] + 1


def test_dropped_clients_free_their_blocks(server, client):
    async def drop_all():
        await asyncio.gather(*[_open_and_drop(server, 2 + i) for i in range(8)])
    asyncio.run(drop_all())
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client giving up
        httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2000,
                                                     "ignore_eos": True}, timeout=0.5)
    m = _wait_idle(server, 3.0)  # well before 9 requests could finish 2000 tokens each
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    r = client.completions.create(model=MODEL, prompt="Still there?", max_tokens=3)
    assert r.usage.completion_tokens == 3


# ---- priority, auth, backpressure ----

def test_priority_auth_and_backpressure(tiny_model_dir, tmp_path):
    """One request runs at a time; a better priority overtakes earlier worse ones, whether from the field or
    from the X-Vllm-Priority header, which overrides the field."""
    args = tiny_args(tiny_model_dir("llama"), "--scheduling-policy", "priority", "--max-num-seqs", "1",
                     "--api-key", "sesame", "--max-concurrent-requests", "5", name=MODEL)
    with serve(args, tmp_path / "server.log", shutdown_s=20) as (url, _):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # every route but /health needs the key
        for path in ("/metrics", "/v1/models", "/version"):
            assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
        order: list[str] = []

        async def first_token(client, name: str, max_tokens: int, priority: int | None = None,
                              header: str | None = None):
            extra = {"ignore_eos": True} | ({"priority": priority} if priority is not None else {})
            stream = await client.completions.create(
                model=MODEL, prompt=f"Request {name}", max_tokens=max_tokens, stream=True, extra_body=extra,
                extra_headers={"X-Vllm-Priority": header} if header else None)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and name not in order:
                    order.append(name)

        async def main():
            async with _aclient(url, "sesame") as client:
                await run(client)

        async def run(client):
            head = asyncio.create_task(first_token(client, "head", 2000))  # holds the one slot until cancelled
            while not order:
                await asyncio.sleep(0.01)
            worse = [asyncio.create_task(first_token(client, f"worse{i}", 5, priority=5)) for i in range(2)]
            await asyncio.sleep(0.2)
            better = [asyncio.create_task(first_token(client, "field", 5, priority=-1)),
                      asyncio.create_task(first_token(client, "header", 5, priority=9, header="-2"))]
            await asyncio.sleep(0.2)
            with pytest.raises(openai.RateLimitError):  # 5 in flight already
                await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            head.cancel()  # the client goes away: its request is aborted and the queue moves
            await asyncio.gather(head, return_exceptions=True)
            await asyncio.gather(*worse, *better)

        asyncio.run(main())
        assert order[:3] == ["head", "header", "field"] and sorted(order[3:]) == ["worse0", "worse1"], order
        m = _metrics(url, "sesame")
        assert m["vllm:request_success_total"] >= 1 and m["vllm:generation_tokens_total"] >= 20
        # One count per request: the four that ran to max_tokens, and the head its client cancelled.
        assert _labelled(url, "sesame", "vllm:request_success_total", finished_reason="length") == 4
        assert _labelled(url, "sesame", "vllm:request_success_total", finished_reason="abort") == 1
        assert "vllm:kv_cache_usage_perc" in m and not any(k.startswith("pressroom:") for k in m)


def test_many_concurrent_streams_complete_without_leaks(server):
    async def one(client, i: int) -> int:
        stream = await client.completions.create(model=MODEL, prompt=f"Load {i}", max_tokens=8, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        async with _aclient(server) as client:
            return await asyncio.gather(*[one(client, i) for i in range(128)])

    assert asyncio.run(main()) == [8] * 128
    assert _wait_idle(server, 10)["vllm:kv_cache_usage_perc"] == 0.0
