"""Hostile input (issue 13, item 6): every attack found by fuzzing gets a 4xx OpenAI-style JSON error within
5 s, and a stream running meanwhile keeps its pace. A real `pressroom serve` on loopback, with an API key and
request chat templates allowed (so that the template bombs reach the sandbox).
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import tiny_args
from serving import serve

from pressroom.entrypoints.openai.chat_template import RENDER_TIMEOUT_S, RENDER_WORKERS

MODEL = "tiny"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]
BODY_READ_TIMEOUT_S = 2.0
MAX_CONCURRENT = 8  # the paced stream and a burst of 6 bombs fit
ANSWER_WITHIN_S = 5.0
MAX_STREAM_GAP_S = 2.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_model_dir, log_path):
    args = tiny_args(tiny_model_dir("llama"), "--api-key", KEY, "--trust-request-chat-template",
                     "--body-read-timeout", str(BODY_READ_TIMEOUT_S), "--max-concurrent-requests", str(MAX_CONCURRENT),
                     name=MODEL)
    with serve(args, log_path, shutdown_s=20) as (url, _):
        yield url


class PacedStream:
    """Streams completions back to back on a thread, noting when each chunk (and each request) happens; the
    largest gap between two of those is how long the server stalled this client."""

    def __init__(self, url: str, model: str = MODEL) -> None:
        self.url, self.model, self.times, self.stop = url, model, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as http:
            while not self.stop.is_set():
                self.times.append(time.monotonic())
                with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    for _line in r.iter_lines():
                        self.times.append(time.monotonic())
                        if self.stop.is_set():
                            break

    def max_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


@contextlib.contextmanager
def paced_stream(url: str, model: str = MODEL):
    stream = PacedStream(url, model)
    stream.thread.start()
    deadline = time.monotonic() + 30
    while len(stream.times) < 5:  # streaming before the attack starts
        assert stream.thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield stream
    finally:
        stream.stop.set()
        stream.thread.join(60)
    assert not stream.thread.is_alive()
    assert stream.max_gap() < MAX_STREAM_GAP_S, f"the stream stalled {stream.max_gap():.2f} s"


def assert_json_error(r: httpx.Response, status: int, seconds: float, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    assert seconds < ANSWER_WITHIN_S, f"{seconds:.1f} s to answer {status}"
    error = r.json()["error"]
    assert error["message"] and error["type"], error
    for leak in ("site-packages", "/tmp", "PreTrainedTokenizer", " object at 0x"):
        assert leak not in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


async def timed_post(http: httpx.AsyncClient, path: str, **kwargs) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = await http.post(path, **kwargs)
    return r, time.monotonic() - started


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


# ---- chat_template_kwargs and request templates ----

TOKENIZER_KWARGS = [  # (chat_template_kwargs, the key the 400 names)
    ({"padding": "max_length", "max_length": 1099511627776}, "padding"),  # was: a 4 TB allocation, process killed
    ({"max_length": 4611686018427387904, "padding": "max_length"}, "max_length"),  # was: a Rust panic, engine dead
    ({"truncation": True, "max_length": 1 << 62}, "truncation"),
    ({"return_tensors": "mlx"}, "return_tensors"),
    ({"tokenize": False}, "tokenize"),
    ({"tokenizer_kwargs": {"padding": "max_length"}}, "tokenizer_kwargs"),
    ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ({"messages": []}, "messages"),
]

BOMBS = [  # request chat templates that looped, allocated or raised
    "{% for i in range(20000) %}{% for j in range(20000) %}...{% endfor %}{% endfor %}",
    "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}",  # no output to count
    '{{ "x" * 30000000 }}',
    "{{ 2 ** 100000000 }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ 1/0 }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ raise_exception('no') }}",
    "{% for %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
]


def test_template_attacks_get_400_while_a_stream_keeps_its_pace(server):
    async def attack():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=30) as http:
            for kwargs, key in TOKENIZER_KWARGS:
                for path, body in (("/v1/chat/completions", chat(chat_template_kwargs=kwargs)),
                                   ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs})):
                    r, seconds = await timed_post(http, path, json=body)
                    assert_json_error(r, 400, seconds, f"chat_template_kwargs.{key}")
            for template in BOMBS:
                r, seconds = await timed_post(http, "/v1/chat/completions", json=chat(chat_template=template))
                assert_json_error(r, 400, seconds)
            # a burst of bombs queues for the render workers: each waits for those before it (one time limit
            # each at most), the stream keeps its pace, and the server still renders afterwards
            burst = BOMBS[:3] * 2
            answers = await asyncio.gather(*[timed_post(http, "/v1/chat/completions", json=chat(chat_template=t))
                                             for t in burst])
            queued_s = RENDER_TIMEOUT_S * math.ceil(len(burst) / RENDER_WORKERS)
            for r, seconds in answers:
                assert_json_error(r, 400, seconds - queued_s)
            r = await http.post("/v1/chat/completions", json=chat(chat_template_kwargs={"enable_thinking": False}))
            assert r.status_code == 200, r.text

    with paced_stream(server):
        asyncio.run(attack())


def test_harmless_template_variables_and_a_trusted_request_template(server):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ greeting }}"
    r = httpx.post(f"{server}/tokenize", headers=AUTH, json={"messages": MESSAGES, "chat_template": template,
                                                           "chat_template_kwargs": {"greeting": "Hello!"}})
    assert r.status_code == 200, r.text
    text = httpx.post(f"{server}/detokenize", headers=AUTH, json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "user: hi\nHello!"


# ---- the body: nesting, its deadline, a client that leaves ----

def test_deeply_nested_json_is_a_400(server):
    async def attack():
        async with httpx.AsyncClient(base_url=server, headers={**AUTH, "content-type": "application/json"},
                                     timeout=30) as http:
            deep = b"[" * 100_000 + b"]" * 100_000
            bodies = [
                b'{"prompt": ' + deep + b"}",
                b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": ' + deep + b"}]}",
                b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": ' + deep + b"}}",
                b'{"a": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}",
            ]
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
                for body in bodies:
                    r, seconds = await timed_post(http, path, content=body)
                    assert_json_error(r, 400, seconds)
            # just below json's own recursion limit, inside a message and the template variables
            nested = {"a": 1}
            for _ in range(400):
                nested = {"a": nested}
            for body in (chat(messages=[{"role": "user", "content": "hi", "x": nested}]),
                         chat(chat_template_kwargs={"deep": nested})):
                r, seconds = await timed_post(http, "/v1/chat/completions", json=body)
                assert r.status_code in (200, 400) and seconds < ANSWER_WITHIN_S, r.text[:300]

    with paced_stream(server):
        asyncio.run(attack())


def _raw_post(url: str, path: str, body_start: bytes, content_length: int) -> socket.socket:
    """An HTTP/1.1 POST that announces `content_length` bytes and sends only `body_start`."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n").encode()
    sock.sendall(head + body_start)
    return sock


def _read_response(sock) -> bytes:
    """The whole response: headers and body may arrive in separate segments."""
    reply = sock.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_half_sent_body_gets_408_and_a_vanished_uploader_no_traceback(server, log_path):
    with paced_stream(server):
        started = time.monotonic()
        with contextlib.closing(_raw_post(server, "/v1/completions", b'{"prompt": "a', 1000)) as sock:
            reply = _read_response(sock)
        seconds = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert BODY_READ_TIMEOUT_S - 0.5 < seconds < BODY_READ_TIMEOUT_S + 3, seconds
        assert b'"error"' in reply and b"request_timeout" in reply
        for _ in range(5):  # clients that go away mid-upload
            _raw_post(server, "/v1/chat/completions", b'{"messages": [', 5000).close()
        time.sleep(0.5)
    log = log_path.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    assert httpx.get(f"{server}/health").status_code == 200


def test_headers_sent_slowly_are_cut_off_while_a_stream_keeps_its_pace(server):
    host, port = server.removeprefix("http://").split(":")
    with paced_stream(server):
        started = time.monotonic()
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(5)]
        for sock in socks:  # headers that never end: a byte now and then
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        for sock in socks:
            with contextlib.closing(sock):
                assert sock.recv(1024) == b""  # closed by the server, no response
        seconds = time.monotonic() - started
        assert BODY_READ_TIMEOUT_S - 0.5 < seconds < BODY_READ_TIMEOUT_S + 3, seconds
    assert httpx.get(f"{server}/health").status_code == 200


# ---- auth, defaults, limits, what errors and /v1/models show ----

def test_every_route_but_health_needs_the_key(server):
    assert httpx.get(f"{server}/health").status_code == 200
    for method, path, body in (("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/version", None),
                               ("GET", "/openapi.json", None), ("POST", "/tokenize", {"prompt": "x" * 100000}),
                               ("POST", "/detokenize", {"tokens": [1, 2]}),
                               ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.request(method, f"{server}{path}", json=body, headers={"Authorization": "Bearer wrong"})
        assert_json_error(r, 401, 0.0)
        assert httpx.request(method, f"{server}{path}", json=body).status_code == 401
    assert httpx.get(f"{server}/metrics", headers=AUTH).status_code == 200


def test_completion_max_tokens_null_or_absent_is_16(server):
    for fields in ({}, {"max_tokens": None}):
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "ignore_eos": True, **fields})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_concurrent_requests_beyond_the_cap_get_429(server):
    async def main():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=60) as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(MAX_CONCURRENT):
                    r = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body))
                    assert r.status_code == 200
                r, seconds = await timed_post(http, "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert_json_error(r, 429, seconds)
                assert r.headers["retry-after"]
            deadline = time.monotonic() + 5  # the server frees a slot once it sees its client gone
            while (r := await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 429:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert r.status_code == 200
    asyncio.run(main())


def test_models_show_the_served_name_not_a_path(server, tiny_model_dir):
    card = httpx.get(f"{server}/v1/models", headers=AUTH).json()["data"][0]
    assert card["id"] == MODEL and card["root"] == MODEL
    assert tiny_model_dir("llama") not in httpx.get(f"{server}/v1/models", headers=AUTH).text


def test_request_chat_template_needs_the_flag(keyed_tiny_server):
    url = keyed_tiny_server  # the tiny llama behind KEY, --disable-metrics-auth, no --trust-request-chat-template
    r, seconds = asyncio.run(_post_once(url, "/v1/chat/completions", chat(chat_template="{{ 1 }}")))
    assert_json_error(r, 400, seconds, "chat_template")
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/metrics").status_code == 200  # opened by --disable-metrics-auth
    assert httpx.get(f"{url}/v1/models").status_code == 401


async def _post_once(url: str, path: str, body: dict) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
        return await timed_post(http, path, json=body)


# ---- a long prompt on the CPU ----

@pytest.mark.slow
def test_a_long_prompt_does_not_freeze_running_streams(tmp_path):
    """The embedded model at the CPU's default step budget: while a 7,900-token prompt is prefilled in chunks
    of the budget, a running stream still gets a token every step. With the old 16k budget the whole prompt was
    one step and every stream froze for minutes (235 s on 2 cores).

    The bound is loose on purpose (shared CI machines): the CPU's chunks are cost-based (a chunk's attention
    grows with its context), so later chunks shrink. Measured with a token-only budget of 512: the prompt in
    114 s, the stream's gaps median 4.8 s, worst 10.3 s; with the cost-based chunks, on a loaded machine at one
    thread, gaps median 1.2 s, worst 2.8 s (tests/engine/test_scheduling.py, opt-in). The whole test took 187 s
    on an idle 2-core EPYC."""
    with serve(["serve", "--api-key", KEY], tmp_path / "server.log") as (url, _):
        model = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"]
        prompt = " ".join(f"word{i % 500}" for i in range(2120))  # about 7,900 tokens
        stream = PacedStream(url, model)
        stream.thread.start()
        while len(stream.times) < 5:
            time.sleep(0.05)
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=900,
                       json={"model": model, "prompt": prompt, "max_tokens": 1})
        ended = time.monotonic()
        stream.stop.set()
        stream.thread.join(60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 7000, r.text[:300]
        gaps = sorted(b - a for a, b in zip(stream.times, stream.times[1:]) if started <= a <= ended)
        assert len(gaps) > 10, gaps  # the stream moved while the prompt was prefilled
        assert gaps[len(gaps) // 2] < 10 and gaps[-1] < 30, (gaps[len(gaps) // 2], gaps[-1])
