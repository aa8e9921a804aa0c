"""Hostile input (issues 13 and 41): every attack found by fuzzing is answered (a 4xx OpenAI-style JSON error within
5 s, or a 200 within its documented cost) while the server keeps its pace for everyone else. A real `pressroom
serve` of the tiny llama on loopback, with an API key and request chat templates allowed (so that the template
bombs reach the sandbox).

Watched through the whole module (the `watch` fixture, started once before the first case), each from a process
of its own (so the test's own work cannot delay it): ONE paced stream (back-to-back streamed completions) whose
largest inter-token gap must stay under 1 s, a /health poller whose every answer must come within 100 ms, and the
API process's RSS, which must grow by less than 500 MB. Each case's teardown checks the stream's gap and /health
within its own window (so a failure names the case); test_the_stream_health_and_memory_held_through_the_module,
the last case on this server, checks the whole module and prints the figures.

Issue 41's cases are in the sections "grammar bombs" to "browsers" below, one parametrized test per kind.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import tiny_args
from serving import pid_serving, serve
from test_edge_validation import SURROGATE_BODIES

from pressroom.entrypoints.openai.chat_template import RENDER_TIMEOUT_S, RENDER_WORKERS

MODEL = "tiny"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
MESSAGES = [{"role": "user", "content": "hi"}]
BODY_READ_TIMEOUT_S = 2.0
MAX_CONCURRENT = 8  # the paced stream and a burst of 6 bombs fit
ANSWER_WITHIN_S = 5.0
BIG = 1 << 70

# The bars the whole module is held to (issue 41's must-show). /health: every answer within 100 ms is the aim; on a
# shared 2-core CI machine the scheduler alone can hold a process off the CPU for some hundreds of milliseconds, so
# the module asserts the 99th percentile under 100 ms and the worst under 500 ms (each case's window the same worst).
MAX_STREAM_GAP_S = 1.0
HEALTH_P99_S = 0.1
HEALTH_MAX_S = 0.5
MAX_RSS_GROWTH = 500 << 20
# A trivial request sent beside a costly one (two grammar bombs, two huge prompts) is answered within this: it must
# not queue behind them (the issue's: 72.5 s behind two depth-800 schemas, 7.5 s behind two 7.9 MB prompts).
BESIDE_WITHIN_S = 2.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "server.log"


@pytest.fixture(scope="module")
def served(tiny_model_dir, log_path) -> Iterator[tuple[str, int]]:
    """The module's server: its URL and its (the API process's) pid."""
    args = tiny_args(tiny_model_dir("llama"), "--api-key", KEY, "--trust-request-chat-template",
                     "--body-read-timeout", str(BODY_READ_TIMEOUT_S), "--max-concurrent-requests", str(MAX_CONCURRENT),
                     name=MODEL)
    with serve(args, log_path, shutdown_s=20) as (url, _):
        yield url, pid_serving(url)



# The watchers: each a process of its own, so that nothing the test process does (building a megabyte body,
# collecting its garbage) can delay them or hide a stall. One line per event, written as it happens:
#   stream: "<time> start" (a request sent), "<time> chunk" (a line of its stream), "<time> error <what>" (it ended);
#   health: "<time> <latency> <status> <the server's RSS>" per /health poll.
# Times are CLOCK_MONOTONIC, which this process shares. Each ends on SIGTERM or when its parent (the run) is gone.
_WATCHER = textwrap.dedent("""
    import os, signal, sys, time
    import httpx, psutil
    what, url, out = sys.argv[1], sys.argv[2], sys.argv[3]
    parent, stop = os.getppid(), []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

    def running():
        return not stop and os.getppid() == parent

    def stream(f, model, max_tokens, key):
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer " + key}, timeout=60) as http:
            while running():
                f.write(f"{time.monotonic()} start\\n")
                with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 429:  # a test filled the server's cap on purpose
                        time.sleep(0.02)
                        continue
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code} {r.read()[:300]!r}")
                    for _ in r.iter_lines():
                        f.write(f"{time.monotonic()} chunk\\n")
                        if not running():
                            break

    def health(f, pid):
        server = psutil.Process(pid)
        with httpx.Client(timeout=10) as http:
            while running():
                sent = time.monotonic()
                try:
                    status = http.get(url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                latency = time.monotonic() - sent
                try:
                    rss = server.memory_info().rss
                except psutil.Error:
                    rss = 0
                f.write(f"{sent} {latency} {status} {rss}\\n")
                time.sleep(0.02)

    with open(out, "w", buffering=1) as f:
        try:
            stream(f, *sys.argv[4:6], sys.argv[6]) if what == "stream" else health(f, int(sys.argv[4]))
        except Exception as e:
            f.write(f"{time.monotonic()} error {e!r}".replace("\\n", " ") + "\\n")
""")


class Watcher:
    """One _WATCHER process and its file of lines."""

    def __init__(self, path: Path, *args: str) -> None:
        self.path = path
        path.touch()  # read before the process has started
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHER, args[0], args[1], str(path), *args[2:]])

    def lines(self) -> list[list[str]]:
        return [line.split(" ", 2) for line in self.path.read_text().splitlines(keepends=True)
                if line.endswith("\n")]  # the last line may be half written

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class PacedStream(Watcher):
    """Streams completions back to back, noting when each chunk (and each request) happens; the largest gap
    between two of those is how long the server stalled this client. A 429 (the server at its concurrency cap,
    which a test may fill on purpose) is retried at once."""

    def __init__(self, path: Path, url: str, model: str = MODEL, max_tokens: int = 400) -> None:
        super().__init__(path, "stream", url, model, str(max_tokens), KEY)

    def times(self) -> list[float]:
        return [float(fields[0]) for fields in self.lines() if fields[1].strip() in ("start", "chunk")]

    def error(self) -> str | None:
        return next((fields[2].strip() for fields in self.lines() if fields[1] == "error"), None)

    def worst_gap(self, since: float, until: float) -> tuple[float, float]:
        """The largest gap that ended in [since, until] (or is still open at `until`), and when it began."""
        times = [t for t in self.times() if t <= until]
        gaps = [(b - a, a) for a, b in zip(times, times[1:]) if b >= since]
        if times and self.running():
            gaps.append((until - times[-1], times[-1]))
        return max(gaps, default=(0.0, since))

    def wait_streaming(self, events: int = 5, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while len(self.times()) < events:
            assert self.running() and self.error() is None, self.error()
            assert time.monotonic() < deadline, "the paced stream did not start"
            time.sleep(0.05)


@dataclass(frozen=True)
class Poll:
    sent: float
    latency: float
    status: int
    rss: int


class HealthPoller(Watcher):
    """Polls /health back to back and reads the server's RSS beside each poll."""

    def __init__(self, path: Path, url: str, pid: int) -> None:
        super().__init__(path, "health", url, str(pid))

    def polls(self, since: float = 0.0, until: float = math.inf) -> list[Poll]:
        polls = [Poll(float(f[0]), float(f[1]), *map(int, f[2].split())) for f in self.lines() if f[1] != "error"]
        return [p for p in polls if since <= p.sent <= until]


@dataclass
class Watch:
    """The module's paced stream, /health poller and RSS readings, and each case's window."""
    stream: PacedStream
    poller: HealthPoller
    windows: list[tuple[str, float, float]] = field(default_factory=list)

    @classmethod
    def start(cls, url: str, pid: int, folder: Path) -> Watch:
        # long requests: seldom between two when a test fills the server's cap
        watch = cls(PacedStream(folder / "stream.txt", url, max_tokens=1500),
                    HealthPoller(folder / "health.txt", url, pid))
        watch.stream.wait_streaming()
        deadline = time.monotonic() + 60
        while len(watch.polls()) < 5:  # polled before the first case
            assert watch.poller.running() and time.monotonic() < deadline, "the /health poller did not start"
            time.sleep(0.05)
        return watch

    def polls(self, since: float = 0.0, until: float = math.inf) -> list[Poll]:
        return self.poller.polls(since, until)

    def window_of(self, t: float) -> str:
        return next((name for name, a, b in self.windows if a <= t <= b), "between cases")

    def check_window(self, name: str, since: float, until: float) -> None:
        """One case's bars: the stream still running, its worst gap, every /health answer in time and a 200."""
        self.windows.append((name, since, until))
        assert self.stream.running() and self.stream.error() is None, f"the paced stream ended: {self.stream.error()}"
        gap, at = self.stream.worst_gap(since, until)
        assert gap < MAX_STREAM_GAP_S, f"the paced stream stalled {gap:.2f} s (from {at - since:.2f} s in)"
        polls = self.polls(since, until)
        assert all(p.status == 200 for p in polls), [p for p in polls if p.status != 200][:5]
        worst = max((p.latency for p in polls), default=0.0)
        assert worst < HEALTH_MAX_S, f"/health took {worst * 1000:.0f} ms"

    def table(self) -> str:
        """Each case's worst stream gap, worst /health answer and the API's RSS peak over the module's first
        reading: where the module's figures come from."""
        polls = self.polls()
        start = polls[0].rss if polls else 0
        rows = []
        for name, since, until in self.windows:
            gap = self.stream.worst_gap(since, until)[0]
            mine = [p for p in polls if since <= p.sent <= until]
            health = max((p.latency for p in mine), default=0.0)
            peak = max((p.rss for p in mine), default=start)
            rows.append(f"  {gap:6.2f} s gap  {health * 1000:7.1f} ms /health  {(peak - start) / 2**20:+7.0f} MiB  "
                        f"{until - since:6.1f} s  {name}")
        return "\n".join(rows)

    def finish(self) -> None:
        self.stream.stop()
        self.poller.stop()


@pytest.fixture(scope="module")
def watch(served, tmp_path_factory) -> Iterator[Watch]:
    url, pid = served
    watch = Watch.start(url, pid, tmp_path_factory.mktemp("watch"))
    try:
        yield watch
    finally:
        watch.finish()


@pytest.fixture
def server(served, watch, request) -> Iterator[str]:
    """The module's server for one case, whose teardown holds the case's window to the module's bars."""
    since = time.monotonic()
    yield served[0]
    watch.check_window(request.node.name, since, time.monotonic())


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


def timed(method: str, url: str, **kwargs) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.request(method, url, timeout=120, **kwargs)
    return r, time.monotonic() - started


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


def raw_chat(extra: str) -> bytes:
    """A chat body with `extra` (raw JSON text: `"key": value`) written into it as is, escapes and all."""
    head = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    return (head + extra + "}").encode()


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
                # the module's paced stream holds one slot, unless it is between two of its requests just now
                opened = 0
                while (r := await stack.enter_async_context(
                        http.stream("POST", "/v1/completions", json=body))).status_code == 200:
                    opened += 1
                assert opened in (MAX_CONCURRENT - 1, MAX_CONCURRENT), opened
                await r.aread()
                assert_json_error(r, 429, 0.0)
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


# ---- issue 41: grammar bombs (each a 400 within 5 s, whatever way the spec is written) ----

DEEP_ITEMS = '{"items":' * 6500 + "{}" + "}" * 6500  # 65,002 characters: was 1.4 GB -> 6.2 GB in 24 s
ESCAPED_PATTERN = '{"type": "string", "pattern": "[a-z]\\u007b1,10000\\u007d"}'  # JSON's \u007b is "{"

GRAMMAR_BOMBS = {
    "schema-depth-6500-as-text": json.dumps(chat(structured_outputs={"json": DEEP_ITEMS})).encode(),
    "schema-depth-6500-in-response-format": raw_chat(
        '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + DEEP_ITEMS + "}}"),
    # the repetition bound written with JSON's unicode escapes: in the body itself, and inside a schema's text
    "pattern-bound-escaped-in-the-body": raw_chat('"structured_outputs": {"json": ' + ESCAPED_PATTERN + "}"),
    "pattern-bound-escaped-in-the-schema-text": json.dumps(chat(structured_outputs={"json": ESCAPED_PATTERN})).encode(),
    "pattern-bound-escaped-in-response-format": raw_chat(
        '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + ESCAPED_PATTERN + "}}"),
    "regex-alternation-10000": json.dumps(chat(structured_outputs={"regex": "(a|b){1,10000}"})).encode(),
    "regex-alternation-30000": json.dumps(chat(structured_outputs={"regex": "(a|b){1,30000}"})).encode(),
}


@pytest.mark.parametrize("name", GRAMMAR_BOMBS)
def test_a_grammar_bomb_is_a_400(server, name):
    r, seconds = timed("POST", f"{server}/v1/chat/completions", content=GRAMMAR_BOMBS[name], headers=JSON_AUTH)
    assert_json_error(r, 400, seconds)


def _nested_items(depth: int) -> str:
    return '{"items":' * depth + "{}" + "}" * depth


async def _beside(url: str, costly: list[tuple[str, bytes]]) -> tuple[list[tuple[httpx.Response, float]],
                                                                     tuple[httpx.Response, float]]:
    """Sends the costly requests at once and, once they are under way, a trivial completion; their answers and
    the trivial one's."""
    async with httpx.AsyncClient(base_url=url, headers=JSON_AUTH, timeout=300) as http:
        sent = [asyncio.create_task(timed_post(http, path, content=body)) for path, body in costly]
        await asyncio.sleep(0.3)
        trivial = await timed_post(http, "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        return await asyncio.gather(*sent), trivial


def test_two_deep_schemas_at_once_leave_other_requests_alone(server):
    """Two depth-800 schemas sent as objects (8 KB each): were 200 after 128 s, and a trivial completion beside them
    waited 72.5 s."""
    body = raw_chat('"structured_outputs": {"json": ' + _nested_items(800) + "}")
    assert 8000 < len(body) < 9000
    answers, (trivial, trivial_s) = asyncio.run(_beside(server, [("/v1/chat/completions", body)] * 2))
    for r, seconds in answers:
        assert_json_error(r, 400, seconds)
    assert trivial.status_code == 200 and trivial_s < BESIDE_WITHIN_S, (trivial.text[:300], trivial_s)


# ---- issue 41: costly requests (a 400 naming the limit within 5 s, or a 200 within their cost) ----

@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir) -> int:
    return json.loads((Path(tiny_model_dir("llama")) / "config.json").read_text())["vocab_size"]


def _whole_vocab_bias(vocab: int) -> dict[str, float]:
    return {str(i): -0.5 for i in range(vocab)}


# name: (the request's path and body from the vocabulary's size, the answer, the field a 400 names, seconds)
COSTLY: dict[str, tuple[Callable[[int], tuple[str, dict]], int, str | None, float]] = {
    # a 989 KB body: was 50 s, other streams stalled 5 s, /health 2.7 s
    "stop-100000-strings-n128": (lambda v: ("/v1/chat/completions", chat(
        stop=[f"stop-{i}" for i in range(100_000)], n=128, max_tokens=10)), 400, "stop", ANSWER_WITHIN_S),
    # was 21.3 s, stalls of 2 s
    "logit-bias-whole-vocab-n128": (lambda v: ("/v1/chat/completions", chat(
        logit_bias=_whole_vocab_bias(v), n=128, max_tokens=10)), 400, "logit_bias", ANSWER_WITHIN_S),
    # At the limits (docs/LIMITS.md): admitted, and cheap for everyone else (the paced stream and /health are the
    # bars). Their own time is bounded loosely, some three times what they took on a busy 2-core machine (load
    # average 5 to 12): 3.0 s, 2.6-5.1 s, 8-14 s and 10 s.
    "stop-1000-strings-20000-chars-n10": (lambda v: ("/v1/chat/completions", chat(
        stop=[f"never-{i:014d}" for i in range(1000)], n=10, max_tokens=10)), 200, None, 10.0),
    "logit-bias-whole-vocab-n6": (lambda v: ("/v1/chat/completions", chat(
        logit_bias=_whole_vocab_bias(v), n=6, max_tokens=10)), 200, None, 15.0),
    # n: 128 and 1,024 prompts are scheduled as the many requests they are, fairly against the paced stream
    "n128-max-tokens-10": (lambda v: ("/v1/chat/completions", chat(n=128, max_tokens=10, ignore_eos=True)),
                           200, None, 40.0),
    "prompts-1024": (lambda v: ("/v1/completions", {
        "model": MODEL, "prompt": [f"Prompt {i} says" for i in range(1024)], "max_tokens": 1, "ignore_eos": True}),
        200, None, 30.0),
}


@pytest.mark.parametrize("name", COSTLY)
def test_a_costly_request_is_refused_or_served_within_its_cost(server, vocab_size, name):
    make, status, param, within_s = COSTLY[name]
    path, body = make(vocab_size)
    content = json.dumps(body).encode()  # made before the clock starts
    r, seconds = timed("POST", f"{server}{path}", content=content, headers=JSON_AUTH)
    print(f"{name}: {r.status_code} in {seconds:.2f} s")
    if status == 200:
        assert r.status_code == 200, r.text[:500]
        assert seconds < within_s, f"{seconds:.1f} s for a 200"
    else:
        assert_json_error(r, status, seconds, param)


def test_two_huge_prompts_at_once_leave_other_requests_alone(server):
    """Two 7.9 MB prompts (under the 8 MiB body limit, far past the context): each tied the tokenizer pool up 9.5 s
    before its 400, and trivial requests waited 7.5 s."""
    body = json.dumps({"model": MODEL, "prompt": "word " * 1_580_000, "max_tokens": 2}).encode()
    assert 7_900_000 <= len(body) < 8 << 20
    answers, (trivial, trivial_s) = asyncio.run(_beside(server, [("/v1/completions", body)] * 2))
    for r, seconds in answers:
        assert_json_error(r, 400, seconds)
    assert trivial.status_code == 200 and trivial_s < BESIDE_WITHIN_S, (trivial.text[:300], trivial_s)


# ---- issue 41: integers past the engine's ranges, unencodable strings, non-ASCII headers (a 400 naming them) ----

ROUTES = {"chat": ("/v1/chat/completions", chat()),
          "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name, value", [("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("priority", BIG),
                                         ("priority", -BIG), ("top_k", BIG)])
def test_an_integer_past_the_engines_range_is_a_400(server, route, name, value):
    path, body = ROUTES[route]
    r, seconds = timed("POST", f"{server}{path}", json={**body, name: value}, headers=AUTH)
    assert_json_error(r, 400, seconds, name)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("header, value", [
    (h, v) for h in ("X-Vllm-Priority", "X-Priority") for v in (str(1 << 63), str(BIG), str(-(1 << 63) - 1),
                                                                 b"\xc2\xb2", b"1\xa0")
] + [("X-Session-Id", b"caf\xc3\xa9"), ("X-Session-Id", b"\xff\xfe")])
def test_a_header_past_int64_or_not_ascii_is_a_400(server, route, header, value):
    path, body = ROUTES[route]
    r, seconds = timed("POST", f"{server}{path}", json=body, headers={**AUTH, header: value})
    assert_json_error(r, 400, seconds, header)


# SURROGATE_BODIES (test_edge_validation): a lone UTF-16 surrogate in `model` was a 500 (UnicodeEncodeError)


@pytest.mark.parametrize("path", SURROGATE_BODIES)
def test_a_lone_surrogate_in_model_is_a_400(server, path):
    r, seconds = timed("POST", f"{server}{path}", content=SURROGATE_BODIES[path].encode(), headers=JSON_AUTH)
    assert_json_error(r, 400, seconds, "model")


# ---- issue 41: logs and browsers ----

FORGED = 'INFO pressroom.access: "POST /v1/admin/delete_all" 200'


def test_a_session_id_cannot_forge_a_log_line(server, log_path):
    session = f"abc\n{FORGED} request_id=x session_id=-\n\u001b[31m"
    for path, body in ROUTES.values():
        r, seconds = timed("POST", f"{server}{path}", json={**body, "session_id": session}, headers=AUTH)
        assert r.status_code == 200 and seconds < ANSWER_WITHIN_S, (r.text[:300], seconds)
    time.sleep(0.5)  # the engine's finished-request line comes after the answer
    text = log_path.read_text()
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text[-4000:]
    assert "\u001b" not in text
    assert "abc\\n" + FORGED in text  # the session id is there, escaped


CROSS_SITE = {  # what a page elsewhere (or on a name its DNS points here) can make a browser send
    "foreign-host": {"Host": "attacker.example"},
    "foreign-origin": {"Origin": "http://attacker.example"},
    "text-plain": {"Content-Type": "text/plain"},
    "all-three": {"Host": "attacker.example", "Origin": "http://attacker.example", "Content-Type": "text/plain"},
}


@pytest.mark.parametrize("name", CROSS_SITE)
def test_a_cross_site_post_is_refused(server, name):
    """Was a 200 (what CSRF and DNS rebinding need); the key is sent, so only the browser checks can refuse it."""
    headers = {**JSON_AUTH, **CROSS_SITE[name]}
    r, seconds = timed("POST", f"{server}/v1/chat/completions", content=json.dumps(chat()).encode(), headers=headers)
    assert 400 <= r.status_code < 500, r.text[:300]
    assert_json_error(r, r.status_code, seconds)


def test_a_rebound_name_cannot_read_and_the_servers_own_origin_is_served(server):
    r, seconds = timed("GET", f"{server}/v1/models", headers={**AUTH, "Host": "attacker.example"})
    assert 400 <= r.status_code < 500, r.text[:300]
    assert_json_error(r, r.status_code, seconds)
    r, seconds = timed("POST", f"{server}/v1/chat/completions", json=chat(), headers={**AUTH, "Origin": server})
    assert r.status_code == 200, r.text[:300]


# ---- the whole module's figures (after every case on this server) ----

def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else max(values, default=0.0)


def test_the_stream_health_and_memory_held_through_the_module(watch):
    watch.finish()
    polls = watch.polls()
    latencies = [p.latency for p in polls]
    worst_poll = max(polls, key=lambda p: p.latency)
    gap, gap_at = watch.stream.worst_gap(0.0, math.inf)
    rss = [p.rss for p in polls if p.rss]
    growth = max(rss) - rss[0]
    figures = (f"stream: {len(watch.stream.times())} events, worst gap {gap:.3f} s ({watch.window_of(gap_at)}); "
               f"/health: {len(polls)} polls, p50 {statistics.median(latencies) * 1000:.1f} ms, "
               f"p99 {_p99(latencies) * 1000:.1f} ms, max {worst_poll.latency * 1000:.1f} ms "
               f"({watch.window_of(worst_poll.sent)}); API RSS {rss[0] >> 20} MiB -> peak {max(rss) >> 20} MiB "
               f"({watch.window_of(max(polls, key=lambda p: p.rss).sent)}), end {rss[-1] >> 20} MiB")
    print(f"{figures}\n{watch.table()}")
    assert gap < MAX_STREAM_GAP_S, figures
    assert all(p.status == 200 for p in polls), figures
    assert _p99(latencies) < HEALTH_P99_S and worst_poll.latency < HEALTH_MAX_S, figures
    assert growth < MAX_RSS_GROWTH, figures


# ---- cases on other servers (after the module's figures: they would load the machine under the paced stream) ----

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
        stream = PacedStream(tmp_path / "stream.txt", url, model)
        stream.wait_streaming()
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=900,
                       json={"model": model, "prompt": prompt, "max_tokens": 1})
        ended = time.monotonic()
        stream.stop()
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 7000, r.text[:300]
        times = stream.times()
        gaps = sorted(b - a for a, b in zip(times, times[1:]) if started <= a <= ended)
        assert len(gaps) > 10, gaps  # the stream moved while the prompt was prefilled
        assert gaps[len(gaps) // 2] < 10 and gaps[-1] < 30, (gaps[len(gaps) // 2], gaps[-1])
