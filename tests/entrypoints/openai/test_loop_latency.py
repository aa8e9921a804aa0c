"""The API process's event loop stays free under heavy requests (issue 41, item 2): /health and /metrics answer
within 100 ms while megabyte prompts, huge stop lists and vocabulary-wide logit_bias arrive; a prompt far past the
context is refused from a prefix of it, not tokenized whole; short tokenizer jobs never queue behind a long one.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import tiny_args
from serving import serve

from pressroom.entrypoints.openai.chat_template import (
    BIG_JOB_CHARS,
    PREFIX_CHARS_PER_TOKEN,
    Preprocessor,
    encode_within,
)
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import EmbeddingData, EmbeddingResponse, UsageInfo
from pressroom.entrypoints.openai.serving import RESPONSE_VALUES_ON_LOOP, _encoded_by_item, output_values

MODEL = "tiny"
VOCAB = 49152  # conftest.TINY_SHAPE
POLL_EVERY_S = 0.02
P99_S, MAX_S = 0.100, 0.250  # the largest allows for a CI machine's scheduling noise
# json.loads of 7 MB of a million lists holds the interpreter in one call: 80 ms on a quiet machine, 300 ms seen
# in a CI run (json's C parser never lets another thread in; a parser in another process would have to send the
# million objects back)
ONE_PARSE_MAX_S = 0.5
HUGE_PROMPT_400_WITHIN_S = 2.0
ANSWER_WITHIN_S = 5.0

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the tiny llama, requests up to 1 MiB (shared: conftest.py)


@pytest.fixture(scope="module")
def big_body_server(tiny_model_dir, tmp_path_factory):
    """For the megabyte bodies of the two slow tests: the default 8 MiB limit, no stats lines."""
    args = tiny_args(tiny_model_dir("llama"), "--log-stats-interval", "0", name=MODEL)
    with serve(args, tmp_path_factory.mktemp("loop-latency") / "server.log") as (url, _):
        yield url


# A process of its own: the test's, with torch imported, pauses for its own garbage collector.
_POLLER = """
import json, sys, threading, time
import httpx
url, every = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(base_url=url, timeout=30) as http:
    http.get("/health")
    print("ready", flush=True)
    while not stop.is_set():
        for path in ("/health", "/metrics"):
            start = time.monotonic()
            ok = http.get(path).status_code == 200
            latencies.append(time.monotonic() - start if ok else 1e9)
        time.sleep(every)
print(json.dumps(latencies), flush=True)
"""


class HealthPoller:
    """GET /health and /metrics every POLL_EVERY_S from a process of its own, noting each answer's latency (a failed
    one counts as endless)."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies = url, []

    def __enter__(self) -> HealthPoller:
        self.proc = subprocess.Popen([sys.executable, "-c", _POLLER, self.url, str(POLL_EVERY_S)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(timeout=60)
        self.latencies = json.loads(out.splitlines()[-1])

    def percentile(self, q: float) -> float:
        ranked = sorted(self.latencies)
        return ranked[min(int(len(ranked) * q), len(ranked) - 1)]


def _post(url: str, path: str, body: bytes, results: dict, key: str) -> None:
    """POSTs a JSON body already encoded (the test's own JSON encoding must not hold its poller back)."""
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    results[key] = (r.status_code, time.monotonic() - start, r.json())


def _encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


# Timed on a 2-core machine beside the rest of the suite, these two measured a p99 of 119-176 ms and one 0.73 s
# answer in full clean-clone runs (7 ms and passing when run alone): their figures belong to a quiet machine, so
# they run with test-slow (make test-slow), not in the default suite.
@pytest.mark.slow
def test_health_and_metrics_answer_within_100ms_while_heavy_requests_arrive(big_body_server):
    server = big_body_server
    text = "hello world, this is a test. " * 268_000  # 7.8 MB, under the default 8 MiB body limit
    messages = [{"role": "user", "content": "hi"}]
    requests = {
        "prompt-1": ("/v1/completions", _encoded({"model": MODEL, "prompt": text, "max_tokens": 5})),
        "prompt-2": ("/v1/completions", _encoded({"model": MODEL, "prompt": text, "max_tokens": 5})),
        "chat": ("/v1/chat/completions", _encoded({"model": MODEL, "max_tokens": 5,
                                                   "messages": [{"role": "user", "content": text}]})),
        "stop": ("/v1/chat/completions", _encoded({"model": MODEL, "messages": messages, "n": 128, "max_tokens": 10,
                                                   "stop": [f"s{i}" for i in range(100_000)]})),
        "logit_bias": ("/v1/chat/completions", _encoded({"model": MODEL, "messages": messages, "n": 16,
                                                         "max_tokens": 10,
                                                         "logit_bias": {str(t): 1.0 for t in range(VOCAB)}})),
        # a million token ids, and a million bad ones (pydantic once reported each of those: seconds)
        "token-ids": ("/v1/completions", _encoded({"model": MODEL, "prompt": [100] * 1_000_000})),
        "bad-ids": ("/v1/completions", _encoded({"model": MODEL, "prompt": [100, "x"] * 500_000})),
    }
    results: dict = {}
    with HealthPoller(server) as poller:
        time.sleep(0.3)  # a baseline before the load
        senders = [threading.Thread(target=_post, args=(server, path, body, results, key))
                   for key, (path, body) in requests.items()]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        time.sleep(0.3)
    for key in ("prompt-1", "prompt-2"):
        status, seconds, body = results[key]
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert seconds < HUGE_PROMPT_400_WITHIN_S, (key, seconds)
    status, seconds, body = results["chat"]
    assert status == 400 and body["error"]["param"] == "messages" and seconds < ANSWER_WITHIN_S, (seconds, body)
    status, seconds, body = results["stop"]
    assert status == 400 and body["error"]["param"] == "stop" and seconds < ANSWER_WITHIN_S, (seconds, body)
    status, seconds, body = results["logit_bias"]
    assert status in (200, 400) and seconds < ANSWER_WITHIN_S, (seconds, body)
    for key in ("token-ids", "bad-ids"):
        status, seconds, body = results[key]
        assert status == 400 and body["error"]["param"].startswith("prompt") and seconds < ANSWER_WITHIN_S, body
    p99, largest = poller.percentile(0.99), max(poller.latencies)
    assert len(poller.latencies) > 20
    assert p99 < P99_S and largest < MAX_S, (f"/health and /metrics: p99 {p99 * 1e3:.0f} ms, largest "
                                             f"{largest * 1e3:.0f} ms over {len(poller.latencies)} answers")


@pytest.mark.slow  # timed: see the note above the previous test
def test_a_million_prompts_are_refused_before_they_are_validated(big_body_server):
    """Their count is judged on the parsed JSON: pydantic takes a microsecond a prompt (1.9 s for these, all of it
    holding the interpreter). Parsing the JSON of a million lists still holds it some 80 ms, hence only the bound
    on the largest /health latency here."""
    server = big_body_server
    body = _encoded({"model": MODEL, "prompt": [[100]] * 1_000_000})  # 7 MB
    results: dict = {}
    with HealthPoller(server) as poller:
        time.sleep(0.2)
        _post(server, "/v1/completions", body, results, "prompts")
        time.sleep(0.2)
    status, seconds, answer = results["prompts"]
    assert status == 400 and answer["error"]["param"] == "prompt" and seconds < ANSWER_WITHIN_S, answer
    assert max(poller.latencies) < ONE_PARSE_MAX_S, sorted(poller.latencies)[-5:]


def test_many_streams_of_16_samples_leave_health_fast(server):
    """One step's outputs of n samples reach the event loop together: their chunks go out in turns."""
    body = _encoded({"model": MODEL, "prompt": "Once upon a time", "n": 16, "max_tokens": 12, "ignore_eos": True,
                     "stream": True, "logprobs": 5})
    chunks: list[int] = []

    async def stream(http: httpx.AsyncClient) -> int:
        async with http.stream("POST", "/v1/completions", content=body,
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status_code == 200
            return sum([1 async for line in r.aiter_lines() if line.startswith("data: {")])

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            chunks.extend(await asyncio.gather(*(stream(http) for _ in range(4))))

    with HealthPoller(server) as poller:
        asyncio.run(main())
    assert chunks == [16 * 12] * 4
    assert poller.percentile(0.99) < P99_S and max(poller.latencies) < MAX_S, sorted(poller.latencies)[-5:]


def test_a_whole_response_of_many_values_is_built_off_the_loop(server):
    """16 choices x 200 tokens x 20 logprobs: past RESPONSE_VALUES_ON_LOOP, encoded choice by choice on a thread."""
    body = {"model": MODEL, "prompt": "Once upon a time", "n": 16, "max_tokens": 200, "ignore_eos": True,
            "logprobs": 20}
    assert output_values([], 20) == 0 and 16 * 200 * 22 > RESPONSE_VALUES_ON_LOOP
    with HealthPoller(server) as poller:
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(16))
    # 20 top logprobs, and the sampled token beside them where it is not among them (vLLM's)
    assert all(len(c["logprobs"]["tokens"]) == 200 and len(c["logprobs"]["top_logprobs"][0]) in (20, 21)
               for c in choices)
    assert poller.percentile(0.99) < P99_S and max(poller.latencies) < MAX_S, sorted(poller.latencies)[-5:]


def test_a_response_encoded_by_item_is_the_whole_encoding():
    data = [EmbeddingData(index=i, embedding=[0.5, 1e-5, -3.0]) for i in range(3)]
    for body in (EmbeddingResponse(model='a "data":[] name', data=data, usage=UsageInfo(prompt_tokens=3)),
                 EmbeddingResponse(model="m", data=[], usage=UsageInfo(prompt_tokens=0))):
        assert json.loads(_encoded_by_item(lambda body=body: body, "data")) == json.loads(json.dumps(body.model_dump()))


# ---- the tokenizer's side, without a server ----

def _counting_encode(calls: list[int]):
    def encode(text: str) -> list[int]:
        calls.append(len(text))
        return [0] * (len(text) // 4)  # some 4 characters a token
    return encode


def test_a_prompt_far_past_the_context_is_refused_from_a_prefix():
    calls: list[int] = []
    with pytest.raises(APIError) as e:
        encode_within(_counting_encode(calls), "x" * 8_000_000, 100, "prompt")
    assert e.value.status == 400 and e.value.param == "prompt" and "context length is 100" in e.value.message
    assert calls == [100 * PREFIX_CHARS_PER_TOKEN]  # the first prefix said it all


def test_a_prompt_that_may_fit_is_tokenized_whole():
    calls: list[int] = []
    assert len(encode_within(_counting_encode(calls), "x" * 1000, 100, "prompt")) == 250
    assert calls == [1000]  # short: no prefix first
    sparse = []  # 64 characters a token: the prefix doubles until it has twice the context, or the text ends
    tokens = encode_within(lambda text: sparse.append(len(text)) or [0] * (len(text) // 64), "x" * 20_000, 100, "p")
    assert len(tokens) == 312 and sparse == [1600, 3200, 6400, 20_000]


def test_short_tokenizer_jobs_do_not_wait_for_long_ones():
    """Two long jobs would take both of the usual tokenizer threads; on their lane they leave those free."""
    pre = Preprocessor(None, 1 << 20)
    first_started, release = threading.Event(), threading.Event()

    def long_job() -> str:
        first_started.set()
        release.wait(10)
        return "long"

    async def main() -> list[str]:
        long = [asyncio.ensure_future(pre.run(long_job, BIG_JOB_CHARS + 1)) for _ in range(2)]
        await asyncio.get_running_loop().run_in_executor(None, first_started.wait, 10)
        short = await asyncio.wait_for(pre.run(lambda: "short", 10), 5)
        release.set()
        return [short, *await asyncio.gather(*long)]

    try:
        assert asyncio.run(main()) == ["short", "long", "long"]
    finally:
        release.set()
        pre.pool.shutdown()
        pre.big_pool.shutdown()
