"""Five of vLLM's serve flags: --enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens: the
prompt's tokens read from the prefix cache, whole and streamed), a --max-logprobs below the default (requests past
it are a 400 naming the limit; up to it they are served), --enable-server-load-tracking (GET /load counts the
requests in flight), --enable-force-include-usage (every stream ends with usage) and --return-tokens-as-token-ids
(logprobs' tokens as "token_id:<id>" unless a request says otherwise). One tiny llama of its own: the session's
shared servers run with none of them."""
from __future__ import annotations

import time
import uuid

import httpx
import pytest
from conftest import tiny_args

MODEL = "tiny"
MAX_LOGPROBS = 3
BLOCK = 16  # the default --block-size: the prefix cache hits whole blocks


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from serving import serve
    args = tiny_args(tiny_model_dir("llama"), "--enable-prompt-tokens-details", "--max-logprobs", str(MAX_LOGPROBS),
                     "--enable-server-load-tracking", "--enable-force-include-usage",
                     "--return-tokens-as-token-ids")
    with serve(args, tmp_path_factory.mktemp("tiny-details") / "server.log") as (url, _):
        yield url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, "temperature": 0, "max_tokens": 2, **body}, timeout=60)


def _prompt() -> str:
    """A prompt of some 50 tokens no earlier request began with (so nothing of it is cached yet)."""
    return f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 4


def test_cached_tokens_count_the_prefix_cache_hits(server):
    prompt = _prompt()
    first = _post(server, "/v1/completions", {"prompt": prompt}).json()["usage"]
    again = _post(server, "/v1/completions", {"prompt": prompt}).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK == 0 and BLOCK <= cached < again["prompt_tokens"]
    # streamed: in the usage chunk
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert f'"prompt_tokens_details":{{"cached_tokens":{cached}}}' in last
    # chat too: its prompt is the rendered conversation
    messages = [{"role": "user", "content": _prompt()}]
    usages = [_post(server, "/v1/chat/completions", {"messages": messages}).json()["usage"] for _ in range(2)]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= BLOCK


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "logprobs"),
])
def test_max_logprobs_bounds_every_logprobs_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert f"of {MAX_LOGPROBS + 1}, which is greater than max allowed: {MAX_LOGPROBS}" in error["message"]
    at_limit = {k: MAX_LOGPROBS if k in ("logprobs", "prompt_logprobs", "top_logprobs") and v is not True else v
                for k, v in body.items()}
    assert _post(server, path, at_limit).status_code == 200


def _load(url: str) -> int:
    return httpx.get(f"{url}/load", timeout=30).json()["server_load"]


def test_load_counts_a_stream_until_it_ends(server):
    assert _load(server) == 0
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # streaming now
        assert _load(server) == 1
        assert [line for line in lines if line][-1] == "data: [DONE]"
    deadline = time.monotonic() + 10
    while _load(server) and time.monotonic() < deadline:  # counted until the response's last send returns
        time.sleep(0.05)
    assert _load(server) == 0


def test_forced_usage_ends_every_stream(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True, "stream": True, **body}
        with httpx.stream("POST", f"{server}{path}", timeout=60, json=body) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert '"choices":[]' in events[-1] and '"completion_tokens":3' in events[-1]  # no stream_options asked
        assert all('"usage":null' in event for event in events[:-1])  # continuous stats still need asking for


def test_tokens_as_ids_by_default_unless_the_request_says(server):
    body = {"prompt": "hi", "logprobs": 1, "return_token_ids": True}
    out = _post(server, "/v1/completions", body).json()["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    out = _post(server, "/v1/completions", dict(body, return_tokens_as_token_ids=False)).json()["choices"][0]
    assert "".join(out["logprobs"]["tokens"]) == out["text"]
