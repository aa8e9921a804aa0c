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
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from pressroom import LLM
from tests.serving import free_port, tail


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _core_pid(server_pid: int) -> int:
    cores = [p for p in _children(server_pid)
             if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(cores) == 1, cores
    return cores[0]


def _start(model: str, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", "serve", "--model", model,
                             "--dtype", "float32", "--kv-cache-memory-gib", "0.05", "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"server exited: {tail(log)}"
        assert time.monotonic() < deadline, f"server did not come up: {tail(log)}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _stream(url: str, first_chunk: threading.Event, result: dict, chat: bool = False) -> None:
    """A long streaming completion (or chat completion); records the SSE events it got and when it ended."""
    body = {"max_tokens": 1500, "ignore_eos": True, "stream": True}
    body |= {"messages": [{"role": "user", "content": "Hello"}]} if chat else {"prompt": "Hello"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = []
    try:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    result["events"], result["ended"] = events, time.monotonic()
    first_chunk.set()


def streams_in_flight(url: str, n: int = 3) -> tuple[list[threading.Thread], list[dict]]:
    """`n` long streams, each past its first chunk (still running) when this returns."""
    results = [{} for _ in range(n)]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_stream, args=(url, e, r)) for e, r in zip(started, results)]
    for t in threads:
        t.start()
    for e, r in zip(started, results):
        assert e.wait(60) and "ended" not in r, r
    return threads, results


def kill_and_wait_for_503(pid: int, url: str, what: str) -> float:
    """SIGKILLs `pid`; asserts /health turns 503 within 5 s; returns when it was killed."""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 5, f"/health still 200 five seconds after {what} died"
        time.sleep(0.05)
    return killed


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    proc, url = _start(tiny_model_dir("llama"), tmp_path / "server.log")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_dead_core_fails_every_request_and_health_within_seconds(server):
    proc, url = server
    core = _core_pid(proc.pid)
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
    assert not _children(proc.pid)


# SIGTERM with test-slow: CI's SIGTERM test (the grace period's, below) also waits for the core to be gone
@pytest.mark.parametrize("how", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGKILL])
def test_no_core_outlives_its_server(server, how):
    proc, _ = server
    core = _core_pid(proc.pid)
    proc.send_signal(how)
    proc.wait(30)
    assert _wait_gone(core, 5), f"the engine core outlived its server ({how.name})"


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "pressroom:num_requests_running")


@pytest.fixture(scope="module")
def timeouts_server(tiny_model_dir, tmp_path_factory):
    """A server with a 2 s shutdown grace and a 2 s stall timeout, shared by the stall test (which leaves it
    serving) and then the SIGTERM test (which ends it): one start instead of two."""
    log_path = tmp_path_factory.mktemp("core-timeouts") / "server.log"
    proc, url = _start(tiny_model_dir("llama"), log_path, "--shutdown-timeout", "2", "--engine-stall-timeout", "2")
    yield proc, url, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=5)


def test_a_stalled_core_turns_health_503_until_it_moves_again(timeouts_server):
    """The core sends a heartbeat every second when idle (outputs every step when busy): stopped (SIGSTOP),
    it is silent, and /health answers 503 once --engine-stall-timeout has passed; resumed, it is 200 again
    (and the server serves on: the SIGTERM test below ends it)."""
    proc, url, _ = timeouts_server
    core = _core_pid(proc.pid)
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
        if _alive(core):
            os.kill(core, signal.SIGCONT)


def test_sigterm_ends_what_outlives_the_grace_period_with_an_error_not_a_cut(timeouts_server):
    """After --shutdown-timeout, each stream still running gets a finish_reason "abort" chunk, an SSE error
    event and [DONE] (no incomplete chunked read); a non-streamed request gets a JSON 503; the server exits
    cleanly before uvicorn's own deadline would have cancelled a handler."""
    proc, url, log_path = timeouts_server
    core = _core_pid(proc.pid)
    results = [{}, {}]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_stream, args=(url, started[0], results[0])),
               threading.Thread(target=_stream, args=(url, started[1], results[1], True))]
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
    log = log_path.read_text()
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "ended 3 request(s) still in flight" in log, log[-3000:]
    assert _wait_gone(core, 5)


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
