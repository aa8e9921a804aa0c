"""The server's engine core runs in a process of its own: its death is seen at once (every in-flight
request ends with an error, /health turns 503, new requests get 503), and no process outlives the server,
however the server ends."""
from __future__ import annotations

import gc
import json
import os
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


def _start(model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pressroom.entrypoints.cli", "serve", "--model", model,
                             "--dtype", "float32", "--kv-cache-memory-gib", "0.05", "--port", str(port)],
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


def _stream(url: str, first_chunk: threading.Event, result: dict) -> None:
    """A long streaming completion; records the SSE events it got and when it ended."""
    body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    result["events"], result["ended"] = events, time.monotonic()
    first_chunk.set()


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
    results = [{} for _ in range(3)]
    started = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_stream, args=(url, e, r)) for e, r in zip(started, results)]
    for t in threads:
        t.start()
    for e, r in zip(started, results):
        assert e.wait(60) and "ended" not in r, r
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 5, "/health still 200 five seconds after the core died"
        time.sleep(0.05)
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


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_core_outlives_its_server(server, how):
    proc, _ = server
    core = _core_pid(proc.pid)
    proc.send_signal(how)
    proc.wait(30)
    assert _wait_gone(core, 5), f"the engine core outlived its server ({how.name})"


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
