"""Faults under load (issue 41, item 8): the server's engine core SIGKILLed while dozens of requests run, and the
server SIGTERMed with dozens of streams open. tests/engine/test_core_process.py holds the same faults with three
requests each (and the stall, and no process outliving the server); here they come with the server busy: 32
streams (completions and chat) and 8 whole-body requests in the engine at once.

After the core's death every in-flight request ends within seconds with an error that names the engine core (a
stream's last events an SSE error and [DONE], a whole body a JSON 503), none hangs, /health turns 503, new requests
get a 503 at once, and the API process lives on to say so, then stops cleanly. After SIGTERM every stream ends
cleanly (an error saying the server is shutting down and [DONE], never a cut connection) within the shutdown
timeout, and the process exits within it and uvicorn's backstop. Each test starts a server of its own (it ends
it): some 30 s on 2 cores each.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import tiny_args
from serving import core_pid, kill_and_wait_for_503, launch, stream_events, tail, wait_gone

from pressroom.entrypoints.openai.server import SHUTDOWN_BACKSTOP_S

STREAMS = 32  # half completions, half chat
WHOLE = 8  # non-streamed requests beside them
ENDED_WITHIN_S = 5.0  # a request ends this soon after the core's death
SHUTDOWN_TIMEOUT_S = 2.0

# slow: two servers under 40 requests each (77 s on 2 cores); test_core_process.py keeps the same faults with 3
# requests in the default suite
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _post_whole(url: str, result: dict) -> None:
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True}
    try:
        result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        result["response"] = e
    result["ended"] = time.monotonic()


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "vllm:num_requests_running")


def _load(url: str) -> tuple[list[threading.Thread], list[dict], list[dict]]:
    """STREAMS streams (each past its first chunk) and WHOLE whole-body requests, all running in the engine when
    this returns: the threads, the streams' results and the whole bodies' results."""
    streams, wholes = [{} for _ in range(STREAMS)], [{} for _ in range(WHOLE)]
    started = [threading.Event() for _ in streams]
    threads = [threading.Thread(target=stream_events, args=(url, e, r, i % 2 == 1))
               for i, (e, r) in enumerate(zip(started, streams))]
    threads += [threading.Thread(target=_post_whole, args=(url, r)) for r in wholes]
    for t in threads:
        t.start()
    for e, r in zip(started, streams):
        assert e.wait(60) and "ended" not in r, r
    deadline = time.monotonic() + 60
    while _running(url) < STREAMS + WHOLE:
        assert time.monotonic() < deadline, f"only {_running(url)} of {STREAMS + WHOLE} requests running"
        time.sleep(0.1)
    return threads, streams, wholes


def _errors(events: list[str]) -> list[dict]:
    return [json.loads(e)["error"] for e in events if e.startswith('{"error"')]


def test_the_cores_death_under_load_ends_every_request_with_an_error(tiny_model_dir, tmp_path):
    with launch(tiny_args(tiny_model_dir("llama")), tmp_path / "server.log") as server:
        url, proc = server.url, server.proc
        core = core_pid(proc.pid)
        threads, streams, wholes = _load(url)
        killed = kill_and_wait_for_503(core, url, "the core")  # /health 503 within 5 s
        for t in threads:
            t.join(ENDED_WITHIN_S + 5)
        assert not any(t.is_alive() for t in threads), "a request hangs after the core's death"
        for r in streams:
            events = r["events"]
            assert r["ended"] - killed < ENDED_WITHIN_S, r["ended"] - killed
            errors = _errors(events)
            assert errors and "engine core" in errors[0]["message"], events[-3:]
            assert events[-1] == "[DONE]", events[-3:]  # a clean end, not a cut connection
        for r in wholes:
            response = r["response"]
            assert isinstance(response, httpx.Response), response
            assert r["ended"] - killed < ENDED_WITHIN_S, r["ended"] - killed
            assert response.status_code == 503, response.text[:300]
            assert "engine core" in response.json()["error"]["message"], response.text[:300]
        started = time.monotonic()
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and time.monotonic() - started < 1, late.text[:300]
        assert late.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert proc.poll() is None, tail(server.log)  # the API lives on to say so
        proc.terminate()
        assert proc.wait(30) in (0, -signal.SIGTERM), tail(server.log)
        assert "Traceback" not in server.log_path.read_text(), tail(server.log)


def test_sigterm_with_streams_open_under_load_ends_each_cleanly_within_the_timeout(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir("llama"), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    with launch(args, tmp_path / "server.log") as server:
        url, proc = server.url, server.proc
        core = core_pid(proc.pid)
        threads, streams, wholes = _load(url)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        exit_within_s = SHUTDOWN_TIMEOUT_S + SHUTDOWN_BACKSTOP_S + 3  # the grace, uvicorn's backstop, the exit
        for t in threads:
            t.join(exit_within_s)
        assert not any(t.is_alive() for t in threads), "a request hangs after SIGTERM"
        for r in streams:
            events = r["events"]
            assert r["ended"] - signalled < SHUTDOWN_TIMEOUT_S + 2, r["ended"] - signalled
            assert events[-1] == "[DONE]", events[-3:]  # a clean end, not a cut connection
            errors = _errors(events)
            assert len(errors) == 1 and "shutting down" in errors[0]["message"], events[-3:]
        for r in wholes:
            response = r["response"]
            assert isinstance(response, httpx.Response), response
            assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
        assert proc.wait(max(0.1, exit_within_s - (time.monotonic() - signalled))) in (0, -signal.SIGTERM)
        log = server.log_path.read_text()
        assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
        assert f"ended {STREAMS + WHOLE} request(s) still in flight" in log, log[-3000:]
        assert wait_gone(core, 5)
