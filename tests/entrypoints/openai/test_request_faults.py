"""A fault in the front-end's handling of ONE request ends that request alone with an error, and a concurrent
request completes normally and the engine serves on afterwards: the tokenizer's decode raising while its output
is detokenized (finish_reason "error" from the engine; a JSON 500 or an SSE error event from the server), or its
encode raising on its prompt (a 400: the client's input)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pressroom import SamplingParams
from pressroom.engine.async_engine import AsyncLLMEngine
from pressroom.entrypoints.openai.server import build_app
from pressroom.entrypoints.openai.settings import ServerSettings

BAD = 49151  # a token id only the failing request's prompt holds (the tiny model's last one)
QUIET = ServerSettings(served_model_name=("tiny",), log_stats_interval=0, log_requests=False)


class FakePanic(BaseException):
    """Like pyo3's PanicException (a Rust tokenizer's panic): a BaseException, not an Exception."""


@pytest.fixture(scope="module")
def engine(tiny_async_engine):
    return tiny_async_engine  # the tiny llama (shared: conftest.py)


@pytest.fixture(params=[RuntimeError, FakePanic], ids=["exception", "panic"])
def failing_decode(request, engine, monkeypatch):
    """The front-end's decode raises whenever the ids it decodes hold BAD (the detokenizer decodes the last
    prompt tokens with the first outputs, so a prompt ending in BAD fails on its first output token)."""
    decode = engine.engine.decode

    def decode_or_fail(ids, skip):
        if BAD in ids:
            raise request.param("injected decode failure")
        return decode(ids, skip)

    monkeypatch.setattr(engine.engine, "decode", decode_or_fail)  # detokenizers made from now on use it


def _greedy(n: int, count: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, n=count)


async def _final(stream):
    outs = [out async for out in stream]
    return outs[-1]


async def _wait_idle(engine: AsyncLLMEngine) -> None:
    for _ in range(200):
        stats = await engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine kept requests or blocks: {stats}")


def test_a_failing_request_ends_alone_and_the_engine_serves_on(engine, failing_decode):
    async def main():
        good = await engine.add_request("good", "Hello", _greedy(40))
        bad = await engine.add_request("bad", [1, 2, BAD], _greedy(40, count=2))
        good_final, bad_final = await asyncio.gather(_final(good), _final(bad))
        after = await _final(await engine.add_request("after", "Good morning", _greedy(5)))
        await _wait_idle(engine)  # the failed request's samples were dropped by the core: no blocks held
        return good_final, bad_final, after

    good, bad, after = asyncio.run(main())
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert good.finished and good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 40
    assert BAD not in good.outputs[0].token_ids and good.outputs[0].text
    assert after.finished and len(after.outputs[0].token_ids) == 5 and after.outputs[0].finish_reason == "length"
    assert engine.is_running and not engine.engine.has_unfinished_requests()


def test_the_server_answers_a_failing_request_with_an_error_and_serves_the_others(engine, failing_decode):
    app = build_app(engine, QUIET)
    bad_prompt = {"model": "tiny", "prompt": [1, 2, BAD], "max_tokens": 20, "ignore_eos": True}
    good_prompt = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "ignore_eos": True}

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=120) as client:
                whole_bad, stream_bad, chat_bad, good = await asyncio.gather(
                    client.post("/v1/completions", json=bad_prompt),
                    client.post("/v1/completions", json=bad_prompt | {"stream": True}),
                    client.post("/v1/chat/completions", json=_bad_chat(engine)),
                    client.post("/v1/completions", json=good_prompt | {"stream": True}))
                health = await client.get("/health")
                after = await client.post("/v1/completions", json=good_prompt | {"max_tokens": 3})
        return whole_bad, stream_bad, chat_bad, good, health, after

    whole_bad, stream_bad, chat_bad, good, health, after = asyncio.run(main())
    assert whole_bad.status_code == 500, whole_bad.text
    assert whole_bad.json()["error"]["type"] == "internal_server_error"
    assert "/" not in whole_bad.json()["error"]["message"]  # no path, no repr of the tokenizer
    for response in (stream_bad, chat_bad):
        events = _events(response)
        assert response.status_code == 200 and events[-1] == "[DONE]", events[-3:]
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert len(errors) == 1 and errors[0]["type"] == "internal_server_error" and errors[0]["code"] == 500
        reasons = [c["finish_reason"] for e in events[:-1] if not e.startswith('{"error"')
                   for c in json.loads(e)["choices"]]
        assert reasons[-1] == "error", reasons
    good_events = _events(good)
    assert not any(e.startswith('{"error"') for e in good_events) and good_events[-1] == "[DONE]"
    text = "".join(c["text"] for e in good_events[:-1] for c in json.loads(e)["choices"])
    assert text and json.loads(good_events[-2])["choices"][0]["finish_reason"] == "length"
    assert health.status_code == 200
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("error", [RuntimeError, FakePanic], ids=["exception", "panic"])
def test_a_tokenizer_failure_on_a_prompt_is_a_400_for_that_request_alone(engine, monkeypatch, error):
    tokenizer = engine.tokenizer
    encode = tokenizer.encode

    def encode_or_fail(text, *args, **kwargs):
        if "boom" in text:
            raise error("injected tokenizer failure")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode_or_fail)
    app = build_app(engine, QUIET)
    good_prompt = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "ignore_eos": True, "stream": True}

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=120) as client:
                return await asyncio.gather(
                    client.post("/v1/completions", json={"model": "tiny", "prompt": "boom", "max_tokens": 5}),
                    client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 5,
                                                              "messages": [{"role": "user", "content": "boom"}]}),
                    client.post("/tokenize", json={"prompt": "boom"}),
                    client.post("/v1/completions", json=good_prompt))

    *bad, good = asyncio.run(main())
    for response in bad:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == "The tokenizer could not process the request's input."
    events = _events(good)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert engine.is_running


def _bad_chat(engine: AsyncLLMEngine) -> dict:
    """A streamed chat request whose rendered prompt ends in BAD: the assistant's message, continued, is BAD's
    text."""
    text = engine.tokenizer.decode([BAD])
    assert engine.tokenizer.encode(f"\n{text}", add_special_tokens=False)[-1] == BAD
    return {"model": "tiny", "max_tokens": 20, "stream": True, "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": text}]}


def _events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
