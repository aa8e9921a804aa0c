"""Faults of disaggregated serving with real processes (the tiny float32 llama): a prefill engine killed before its
KV is read, a decode engine killed mid-stream, a read that never completes, corrupted chunks. Each request ends
with an error or is recomputed with the output one engine gives, and no block or staging chunk stays held; the
router takes a dead engine out (a request not yet streamed is retried on another pair) and answers 503 at once
when no engine of a role is left. Slow: eight processes on a 2-core machine."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from disagg.disagg_support import MODEL, engine_args, metrics, router_args, started, transfer_config

pytestmark = pytest.mark.slow

PROMPT = "A request whose KV transfer goes wrong still gets the answer one engine gives, or a clear error"


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_model_dir):
    model = engine_args(tiny_model_dir("llama"))
    specs = {"prefill": model + transfer_config("kv_producer", abort_request_timeout_s=5),
             "prefill_corrupt": model + transfer_config("kv_producer", fault_injection="corrupt_staged"),
             "prefill_doomed": model + transfer_config("kv_producer"),
             "decode": model + transfer_config("kv_consumer", transfer_timeout_s=3),
             "decode_stalled": model + transfer_config("kv_consumer", transfer_timeout_s=2,
                                                       fault_injection="stall_reads"),
             "decode_doomed": model + transfer_config("kv_consumer")}
    tmp = tmp_path_factory.mktemp("disagg-faults")
    with started(specs, tmp) as servers:
        p, dead, live = servers["prefill"].url, servers["decode_doomed"].url, servers["decode"].url
        routers = {"router_one": router_args([p], [dead]),  # its only decode engine dies
                   # never probes again: it finds the dead engine by a request
                   "router_two": router_args([p], [dead, live], "--health-interval", "600")}
        with started(routers, tmp) as fronts:
            yield {**servers, **fronts}


def completion(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def staged_params(engines, name: str) -> dict:
    params = completion(engines[name].url, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()
    return params["kv_transfer_params"]


def idle(url: str, seconds: float = 15.0) -> None:
    """Waits until the engine holds no KV block and no staging chunk."""
    deadline = time.monotonic() + seconds
    while (m := metrics(url))["kv_cache_usage_perc"] + m.get("kv_transfer_staging_chunks_used", 0):
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


@pytest.fixture(scope="module")
def want(engines) -> str:
    return text(completion(engines["prefill"].url))


def test_prefill_engine_killed_before_its_kv_is_read(engines, want):
    params = staged_params(engines, "prefill_doomed")
    engines["prefill_doomed"].proc.send_signal(signal.SIGKILL)
    engines["prefill_doomed"].proc.wait(10)
    failed = metrics(engines["decode"].url)["kv_transfer_failed_reads_total"]
    assert text(completion(engines["decode"].url, kv_transfer_params=params)) == want
    assert metrics(engines["decode"].url)["kv_transfer_failed_reads_total"] == failed + 1
    idle(engines["decode"].url)


def test_a_read_that_never_completes_times_out(engines, want):
    params = staged_params(engines, "prefill")
    start = time.monotonic()
    assert text(completion(engines["decode_stalled"].url, kv_transfer_params=params)) == want
    assert time.monotonic() - start >= 2  # its transfer timeout, then the prompt computed
    assert metrics(engines["decode_stalled"].url)["kv_transfer_failed_reads_total"] >= 1
    idle(engines["decode_stalled"].url)
    idle(engines["prefill"].url)  # told to drop its chunks (or let them go after 5 s)


def test_corrupted_chunks_are_not_used(engines, want):
    params = staged_params(engines, "prefill_corrupt")
    before = metrics(engines["decode"].url)["kv_transfer_corrupt_chunks_total"]
    assert text(completion(engines["decode"].url, kv_transfer_params=params)) == want
    assert metrics(engines["decode"].url)["kv_transfer_corrupt_chunks_total"] == before + 1
    idle(engines["decode"].url)
    idle(engines["prefill_corrupt"].url)


def test_decode_engine_killed_mid_stream(engines):
    router = engines["router_one"].url
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    events = []
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:  # streaming: the decode engine dies
                    engines["decode_doomed"].proc.send_signal(signal.SIGKILL)
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert "failed mid-stream" in json.loads(events[-2])["error"]["message"]
    start = time.monotonic()
    response = completion(router)
    assert response.status_code == 503 and "no healthy decode engine" in response.json()["error"]["message"]
    assert time.monotonic() - start < 5
    assert httpx.get(router + "/health", timeout=5).status_code == 503
    idle(engines["prefill"].url)  # its chunks were read before the stream began


def test_a_dead_engine_is_found_and_the_request_retried(engines, want):
    """router_two never probes again: it learns of the dead decode engine from a request, which goes to the other."""
    router = engines["router_two"].url
    engines["decode_doomed"].proc.kill()  # dead (if the test before did not kill it)
    engines["decode_doomed"].proc.wait(10)
    for _ in range(3):  # round robin: one of these picks the dead engine first
        assert text(completion(router)) == want
    states = {e["url"]: e["healthy"] for e in httpx.get(router + "/engines", timeout=5).json()}
    assert states[engines["decode_doomed"].url] is False and states[engines["decode"].url] is True
    idle(engines["prefill"].url)
    idle(engines["decode"].url)
