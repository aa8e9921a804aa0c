"""The edge (issue 41, items 5 and 6): every integer field and header is range-checked against what the engine can
take, every string checked for encodability, each a 400 in OpenAI's shape naming the field, never a 500; and a
request's strings reach the log escaped, so that they cannot forge a line. A real `pressroom serve` on loopback
(its log read back), and the helpers in process.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.serving import request_priority, request_session_id
from pressroom.logger import printable

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
BIG = 1 << 70
JSON = {"Content-Type": "application/json"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny_served) -> str:
    return tiny_served[0]  # the tiny llama, a line logged per finished request (shared: conftest.py)


@pytest.fixture(scope="module")
def log_path(tiny_served) -> Path:
    return tiny_served[1]


ROUTES = {"chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
          "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2})}


def _assert_400_naming(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], error


# ---- integers: the engine's ranges (int64; a seed uint64) ----

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field, value", [
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("priority", BIG), ("priority", -BIG), ("top_k", BIG),
    ("n", BIG), ("max_tokens", BIG), ("max_tokens", -BIG), ("min_tokens", BIG), ("data_parallel_rank", BIG),
])
def test_an_integer_past_the_engines_range_is_a_400_naming_it(server, route, field, value):
    path, body = ROUTES[route]
    _assert_400_naming(httpx.post(f"{server}{path}", json={**body, field: value}, timeout=30), field)


@pytest.mark.parametrize("route, field", [
    ("chat", "max_completion_tokens"), ("chat", "top_logprobs"), ("chat", "thinking_token_budget"),
    ("completions", "logprobs"), ("completions", "best_of"),
])
def test_each_routes_own_integers_are_range_checked(server, route, field):
    path, body = ROUTES[route]
    _assert_400_naming(httpx.post(f"{server}{path}", json={**body, field: BIG}, timeout=30), field)


@pytest.mark.parametrize("route", ROUTES)
def test_every_64_bit_seed_still_works(server, route):
    path, body = ROUTES[route]
    for seed in ((1 << 64) - 1, -(1 << 63)):
        r = httpx.post(f"{server}{path}", json={**body, "seed": seed, "temperature": 1.0}, timeout=60)
        assert r.status_code == 200, r.text
    # sample i draws with seed + i, wrapped to 64 bits
    r = httpx.post(f"{server}{path}", json={**body, "seed": (1 << 64) - 1, "n": 2, "temperature": 1.0}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("header", ["X-Vllm-Priority", "X-Priority"])
@pytest.mark.parametrize("value", [str(1 << 63), str(-(1 << 63) - 1), str(BIG), b"\xc2\xb2", b"1\xa0"])
def test_a_priority_header_past_int64_or_not_ascii_is_a_400(server, route, header, value):
    path, body = ROUTES[route]
    _assert_400_naming(httpx.post(f"{server}{path}", json=body, headers={header: value}, timeout=30), header)


def test_non_ascii_session_header_is_a_400(server):
    for route in ROUTES.values():
        path, body = route
        r = httpx.post(f"{server}{path}", json=body, headers={"X-Session-Id": b"caf\xc3\xa9"}, timeout=30)
        _assert_400_naming(r, "X-Session-Id")
    r = httpx.post(f"{server}/v1/completions", json=ROUTES["completions"][1], headers={"X-Session-Id": "cafe-1"})
    assert r.status_code == 200, r.text


def test_embedding_integers_are_range_checked(server):  # checked before the route finds this model generates
    for field in ("dimensions", "priority"):
        r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": "hi", field: BIG}, timeout=30)
        _assert_400_naming(r, field)


# ---- strings: a lone UTF-16 surrogate (JSON's \ud800) cannot be encoded ----

SURROGATE_BODIES = {
    "/v1/chat/completions": '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
    "/v1/completions": '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}',
    "/v1/embeddings": '{"model": "\\ud800", "input": "hi"}',
    "/tokenize": '{"model": "\\udfff", "prompt": "hi"}',
    "/score": '{"model": "\\ud800", "text_1": "a", "text_2": "b"}',
}


@pytest.mark.parametrize("path", SURROGATE_BODIES)
def test_a_lone_surrogate_in_model_is_a_400_naming_it(server, path):
    r = httpx.post(f"{server}{path}", content=SURROGATE_BODIES[path].encode(), headers=JSON, timeout=30)
    _assert_400_naming(r, "model")


@pytest.mark.parametrize("body, param", [
    ('{"messages": [{"role": "user", "content": "a\\udc00b"}]}', "messages.0.content"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\ud83d"]}', "stop.1"),
    ('{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\\ud800": 1}}',
     "chat_template_kwargs"),
])
def test_every_string_is_checked_not_only_model(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", content=body.encode(), headers=JSON, timeout=30)
    _assert_400_naming(r, param)


def test_a_surrogate_pair_is_text(server):
    body = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'  # one emoji
    r = httpx.post(f"{server}/v1/chat/completions", content=body.encode(), headers=JSON, timeout=60)
    assert r.status_code == 200, r.text


# ---- logs: a request's strings cannot forge a line ----

FORGED = 'INFO pressroom.access: "POST /v1/admin/delete_all" 200'


def _log_lines(log_path: Path, pattern: str, seconds: float = 10) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        lines = [line for line in log_path.read_text().splitlines() if re.search(pattern, line)]
        if lines:
            return lines
        assert time.monotonic() < deadline, (pattern, log_path.read_text()[-4000:])
        time.sleep(0.1)


def test_a_session_id_cannot_forge_log_lines(server, log_path):
    session = f'abc\n{FORGED} request_id=x session_id=-\n\u001b[31m'
    for path, body in ROUTES.values():
        r = httpx.post(f"{server}{path}", json={**body, "session_id": session}, timeout=60)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        access = _log_lines(log_path, f"request_id={rid} ")  # the access line, and the engine's finished line
        finished = _log_lines(log_path, f"Finished request {rid}")
        assert len(access) == 1 and len(finished) == 1
        escaped = "abc\\n" + FORGED
        assert escaped in access[0] and escaped in finished[0], (access, finished)
    text = log_path.read_text()
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text[-4000:]
    assert "\u001b" not in text


def test_a_path_cannot_forge_log_lines(server, log_path):
    r = httpx.get(f"{server}/v1/x%0A{FORGED.replace(' ', '%20')}%1B[31m", timeout=30)
    assert r.status_code == 404
    _log_lines(log_path, re.escape('"GET /v1/x\\nINFO pressroom.access: "POST /v1/admin/delete_all" 200'))
    text = log_path.read_text()
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text[-4000:]
    assert "\u001b" not in text


def test_a_request_id_header_cannot_forge_log_lines(server, log_path):
    # NEL (0x85) is a line break to Python's str.splitlines; latin-1 is how the server decodes header bytes
    headers = {"X-Request-Id": b"rid-9\x85" + FORGED.encode()}
    r = httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 200, r.text
    _log_lines(log_path, re.escape("request_id=rid-9\\x85" + FORGED + " session_id=-"))


# ---- the helpers, in process ----

def _request(headers: dict[str, bytes]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v) for k, v in headers.items()]})


@pytest.mark.parametrize("value, expected", [
    (b"-9223372036854775808", -(1 << 63)), (b"9223372036854775807", (1 << 63) - 1), (b"+5", 5),
])
def test_priority_header_takes_all_of_int64(value, expected):
    assert request_priority(_request({"X-Vllm-Priority": value}), None) == expected


@pytest.mark.parametrize("value", [b"9223372036854775808", b" 5", b"5_0", b"", b"\xd9\xa1"])
def test_priority_header_past_int64_or_not_plain_digits_is_a_400(value):
    with pytest.raises(APIError) as e:
        request_priority(_request({"X-Priority": value}), 1)
    assert e.value.status == 400 and e.value.param == "X-Priority"


def test_session_header_must_be_printable_ascii():
    assert request_session_id(_request({"X-Session-Id": b"conv 7"}), None) == "conv 7"
    for value in (b"caf\xc3\xa9", b"a\tb"):
        with pytest.raises(APIError) as e:
            request_session_id(_request({"X-Session-Id": value}), None)
        assert e.value.status == 400 and e.value.param == "X-Session-Id"


@pytest.mark.parametrize("text, expected", [
    ("conv-7 caf\u00e9", "conv-7 caf\u00e9"),
    ("a\nb\r\u001b[31m", "a\\nb\\r\\x1b[31m"),
    ("a\\nb", "a\\\\nb"),  # a backslash cannot fake an escape
    ("\u2028\u202e\ud800", "\\u2028\\u202e\\ud800"),  # line separator, bidi override, lone surrogate
])
def test_printable_escapes_what_could_forge_or_hide_a_line(text, expected):
    assert printable(text) == expected
