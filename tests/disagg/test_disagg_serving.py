"""Disaggregated serving with real processes on loopback: a prefill engine (NIXL producer), a decode engine
(consumer) and `pressroom router` give the greedy outputs the prefill engine gives alone (the tiny float32 llama:
disagg_support.engine_args says why not SmolLM2), completions and chat,
streamed and whole, prompts with shared and distinct prefixes; the decode engine computes one prompt token per
request (the last, which it did not receive) and counts the KV it received; no block or staging chunk is left held.
Bad input gets a clear error at once."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg.disagg_support import MODEL, Disagg, metrics, source

SHARED = ("You are a careful assistant who answers questions about geography, history and science in short, "
          "precise sentences, and who never makes up facts. ")
TOPICS = ["the river Nile", "the Roman empire", "photosynthesis", "the planet Mars", "volcanoes", "the printing press",
          "honey bees", "the moon landing", "glaciers", "the human heart", "tides", "the Silk Road"]


def requests(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """(path, body): completions and chat, whole and streamed; half share a long prefix, half do not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        prefix = SHARED if i % 2 == 0 else ""
        common = {"model": MODEL, "temperature": 0, "max_tokens": rng.randint(4, 10), "stream": i % 4 >= 2}
        if i % 3 == 0:
            text = prefix + f"Tell me one fact about {topic}."
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}))
        else:
            text = prefix + f"Here is one fact about {topic}{' in history' * rng.randint(0, 2)}: it"
            out.append(("/v1/completions", {**common, "prompt": text}))
    return out


def answer(url: str, path: str, body: dict) -> str:
    """The text of the one choice; a stream's deltas joined (an error event fails the test)."""
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    parts = []
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def run_all(url: str, batch: list[tuple[str, dict]], workers: int = 6) -> list[str]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: answer(url, *item), batch))


def settled(disagg: Disagg, seconds: float = 10.0) -> tuple[dict, dict]:
    """Both engines' metrics once every block and staging chunk is back (the producer lets go of its chunks when
    the consumer's word arrives)."""
    deadline = time.monotonic() + seconds
    while True:
        p, d = metrics(disagg.prefill.url), metrics(disagg.decode.url)
        held = p["kv_cache_usage_perc"] + d["kv_cache_usage_perc"] + p["kv_transfer_staging_chunks_used"] + \
            d["kv_transfer_staging_chunks_used"]
        if held == 0 or time.monotonic() > deadline:
            return p, d
        time.sleep(0.2)


def check_identity(disagg: Disagg, batch: list[tuple[str, dict]]) -> None:
    want = run_all(disagg.prefill.url, batch)  # one engine alone
    before_p, before_d = settled(disagg)
    got = run_all(disagg.router, batch)
    assert got == want
    after_p, after_d = settled(disagg)
    for engine in (after_p, after_d):
        assert engine["kv_cache_usage_perc"] == 0 and engine["kv_transfer_staging_chunks_used"] == 0
    delta = {k: after_d[k] - before_d.get(k, 0) for k in after_d}
    # each request computed exactly one prompt token on the decode engine: the last, which it was not sent
    assert source(after_d, "local_compute") - source(before_d, "local_compute") == len(batch)
    assert delta["kv_transfer_received_tokens_total"] > 0 and delta["kv_transfer_received_bytes_total"] > 0
    assert source(after_d, "external_kv_transfer") - source(before_d, "external_kv_transfer") == \
        delta["kv_transfer_received_tokens_total"]
    # vLLM's families of a KV connector's lookups: every request asked it (its whole prompt), the received tokens hit
    assert delta["external_prefix_cache_hits_total"] == delta["kv_transfer_received_tokens_total"]
    assert delta["external_prefix_cache_queries_total"] > delta["external_prefix_cache_hits_total"]
    assert delta[f'prompt_tokens_cached_by_source_total{{engine="0",model_name="{MODEL}",source="p2p"}}'] == \
        delta["kv_transfer_received_tokens_total"]
    assert delta["kv_transfer_reads_total"] > 0 and delta["kv_transfer_failed_reads_total"] == 0
    sent = after_p["kv_transfer_sent_bytes_total"] - before_p["kv_transfer_sent_bytes_total"]
    assert sent == delta["kv_transfer_received_bytes_total"]  # every chunk read was confirmed, none left staged


def test_disaggregated_outputs_equal_one_engine(disagg):
    check_identity(disagg, requests(20))


@pytest.mark.slow  # 200 requests through three processes: minutes on 2 cores
def test_disaggregated_outputs_equal_one_engine_200(disagg):
    check_identity(disagg, requests(200, seed=1))


def prefill_params(disagg: Disagg, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(disagg.prefill.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def test_an_unreachable_producer_means_the_prompt_is_computed(disagg):
    prompt = "An unreachable peer: the decode engine waits for its transfer, then computes the prompt itself"
    params = {**prefill_params(disagg, prompt), "remote_engine_id": "nowhere", "remote_port": 9}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    want = answer(disagg.prefill.url, "/v1/completions", body)
    failed = metrics(disagg.decode.url)["kv_transfer_failed_reads_total"]
    start = time.monotonic()
    assert answer(disagg.decode.url, "/v1/completions", {**body, "kv_transfer_params": params}) == want
    assert time.monotonic() - start < 30  # the 3 s transfer timeout, then the prompt
    assert metrics(disagg.decode.url)["kv_transfer_failed_reads_total"] == failed + 1
    after = metrics(disagg.decode.url)  # nothing held here (the producer lets go of its unread chunks after 8 s)
    assert after["kv_cache_usage_perc"] == 0 and after["kv_transfer_staging_chunks_used"] == 0


@pytest.mark.parametrize("change, status, message", [
    ({"block_size": 32}, 400, "block size 32, this engine 16"),
    ({"remote_block_ids": None}, 400, "lacks remote_block_ids"),
    ({"model_fingerprint": "00" * 16}, 400, "model fingerprints differ"),  # another model (or its settings)
])
def test_foreign_transfer_params_are_refused(disagg, change, status, message):
    params = prefill_params(disagg, "Params from an engine that does not match this one")
    params = {k: v for k, v in {**params, **change}.items() if v is not None}
    body = {"model": MODEL, "prompt": "Params from an engine that does not match this one", "max_tokens": 4,
            "kv_transfer_params": params}
    response = httpx.post(disagg.decode.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_roles_are_kept(disagg):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(disagg.decode.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "kv_role is kv_consumer" in response.json()["error"]["message"]


def test_router_passes_client_errors_on(disagg):
    response = httpx.post(disagg.router + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]
    response = httpx.post(disagg.router + "/v1/completions", content=b"[1, 2]", timeout=30)
    assert response.status_code == 400
    engines = httpx.get(disagg.router + "/engines", timeout=10).json()
    assert [e["healthy"] for e in engines] == [True, True]
