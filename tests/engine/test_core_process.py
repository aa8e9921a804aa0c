"""The server's engine core runs in a process of its own: its death is seen at once (every in-flight
request ends with an error, /health turns 503, new requests get 503), a stalled core turns /health 503 until
it moves again, SIGTERM ends the requests still running after the grace period with an error (never a cut
stream), and no process outlives the server, however the server ends."""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time
import weakref

import httpx
import pytest
from conftest import tiny_args
from serving import (
    alive,
    children,
    core_pid,
    kill_and_wait_for_503,
    launch,
    stream_events,
    streams_in_flight,
    wait_gone,
)

from pressroom import LLM


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    """A server of the tiny llama for one test, which ends it."""
    with launch(tiny_args(tiny_model_dir("llama")), tmp_path / "server.log") as server:
        yield server


def test_a_dead_core_fails_every_request_and_health_within_seconds(server):
    proc, url = server.proc, server.url
    core = core_pid(proc.pid)
    threads, results = streams_in_flight(url)
    killed = kill_and_wait_for_503(core, url, "the core")
    for t in threads:
        t.join(10)
    for r in results:
        assert r["ended"] - killed < 5
        errors = [json.loads(e)["error"] for e in r["events"] if e.startswith('{"error"')]
        assert errors and "engine core" in errors[0]["message"], r["events"][-3:]
    late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    assert proc.poll() is None  # the front-end lives on to say so
    proc.terminate()
    assert proc.wait(30) in (0, -signal.SIGTERM)
    assert not children(proc.pid)


# SIGTERM with test-slow: CI's SIGTERM test (the grace period's, below) also waits for the core to be gone
@pytest.mark.parametrize("how", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGKILL])
def test_no_core_outlives_its_server(server, how):
    proc = server.proc
    core = core_pid(proc.pid)
    proc.send_signal(how)
    proc.wait(30)
    assert wait_gone(core, 5), f"the engine core outlived its server ({how.name})"


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "vllm:num_requests_running")


@pytest.fixture(scope="module")
def timeouts_server(tiny_model_dir, tmp_path_factory):
    """A server with a 2 s shutdown grace and a 2 s stall timeout, shared by the stall test (which leaves it
    serving) and then the SIGTERM test (which ends it): one start instead of two."""
    args = tiny_args(tiny_model_dir("llama"), "--shutdown-timeout", "2", "--engine-stall-timeout", "2")
    with launch(args, tmp_path_factory.mktemp("core-timeouts") / "server.log") as server:
        yield server


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=5)


def test_a_stalled_core_turns_health_503_until_it_moves_again(timeouts_server):
    """The core sends a heartbeat every second when idle (outputs every step when busy): stopped (SIGSTOP),
    it is silent, and /health answers 503 once --engine-stall-timeout has passed; resumed, it is 200 again
    (and the server serves on: the SIGTERM test below ends it)."""
    url, core = timeouts_server.url, core_pid(timeouts_server.proc.pid)
    try:
        assert _health(url).status_code == 200
        os.kill(core, signal.SIGSTOP)
        stopped = time.monotonic()
        while (health := _health(url)).status_code != 503:
            assert time.monotonic() - stopped < 2 + 2, "/health still 200 with the core stopped past the timeout"
            time.sleep(0.1)
        error = health.json()["error"]
        assert error["type"] == "service_unavailable" and "no progress" in error["message"], error
        silent = float(re.search(r"for ([0-9.]+) s", error["message"]).group(1))
        # Not before the stall timeout (counted from the last heartbeat, up to 1 s before the stop); the message
        # rounds to 0.1 s, so a silence just past 2 s reads "2.0".
        assert silent >= 2
        os.kill(core, signal.SIGCONT)
        resumed = time.monotonic()
        while _health(url).status_code != 200:
            assert time.monotonic() - resumed < 5, "/health still 503 after the core resumed"
            time.sleep(0.1)
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                          timeout=60)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
    finally:
        if alive(core):
            os.kill(core, signal.SIGCONT)


def test_sigterm_ends_what_outlives_the_grace_period_with_an_error_not_a_cut(timeouts_server):
    """After --shutdown-timeout, each stream still running gets a finish_reason "abort" chunk, an SSE error
    event and [DONE] (no incomplete chunked read); a non-streamed request gets a JSON 503; the server exits
    cleanly before uvicorn's own deadline would have cancelled a handler."""
    proc, url = timeouts_server.proc, timeouts_server.url
    core = core_pid(proc.pid)
    results = [{}, {}]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=stream_events, args=(url, started[0], results[0])),
               threading.Thread(target=stream_events, args=(url, started[1], results[1], True))]
    whole: dict = {}

    def post() -> None:
        body = {"prompt": "Hi", "max_tokens": 1500, "ignore_eos": True}
        try:
            whole["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            whole["response"] = e

    threads.append(threading.Thread(target=post))
    for t in threads:
        t.start()
    for e, r in zip(started, results):
        assert e.wait(60) and "ended" not in r, r
    deadline = time.monotonic() + 30
    while _running(url) < 3:  # all three are in the engine
        assert time.monotonic() < deadline, "the requests did not all start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for t in threads:
        t.join(30)
    for r in results:
        events = r["events"]
        assert 1.5 < r["ended"] - signalled < 2 + 2, r["ended"] - signalled  # the grace, then at once
        assert events[-1] == "[DONE]", events[-3:]  # a clean end, not a transport error
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert len(errors) == 1 and errors[0]["type"] == "service_unavailable", events[-3:]
        assert "shutting down" in errors[0]["message"]
        chunks = [json.loads(e) for e in events[:-1] if not e.startswith('{"error"')]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "abort" and reasons.count("abort") == 1, reasons[-3:]
        assert events[-2].startswith('{"error"')  # finish reason, then the error, then [DONE]
    response = whole["response"]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in response.json()["error"]["message"]
    assert proc.wait(30) in (0, -signal.SIGTERM)
    log = timeouts_server.log_path.read_text()
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "ended 3 request(s) still in flight" in log, log[-3000:]
    assert wait_gone(core, 5)


def _engine_refs(llm) -> list[weakref.ref]:
    runner = llm.engine.runner
    return [weakref.ref(runner.kv_caches[0]), weakref.ref(next(runner.model.parameters()))]


@pytest.mark.parametrize("how", ["shutdown", "with", "del"])
def test_an_offline_llm_returns_its_memory_at_once(tiny_model_dir, how):
    """The KV pool and the weights are freed when the LLM is shut down, leaves its `with` block, or is
    deleted, without waiting for a garbage collection (the model's modules hold reference cycles)."""
    gc.disable()  # what is freed must be freed by the shutdown itself
    try:
        llm = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)
        refs = _engine_refs(llm)
        if how == "shutdown":
            llm.shutdown()
            with pytest.raises(RuntimeError, match="shut down"):
                llm.generate("Hello")
        elif how == "with":
            with llm:
                pass
        else:
            del llm
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
