"""E/P/D with real processes on loopback: an encode engine, a prefill engine and a decode engine of a tiny float32
Qwen2.5-VL (NIXL producers and a consumer) behind `pressroom router --encode URL --prefill URL --decode URL` give
the greedy outputs one engine gives alone for chats with shared and distinct images; the prefill engine's encoder
never runs for media whose encoder outputs it received (its /metrics mm_encoder_runs stays 0), nor does the decode
engine's; an encoder output corrupted in transit (the encode engine's corrupt_staged fault) is caught by its
checksum and the prefill engine encodes the image itself, with the same output."""
from __future__ import annotations

import copy
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "multimodal"))  # tiny_vl

pytest.importorskip("nixl", reason="the NixlConnector's transport (pip install nixl, or make install-test)")

from disagg.disagg_support import (  # noqa: E402
    MODEL,
    free_port,
    metrics,
    router_args,
    source,
    started,
    transfer_config,
    with_free_kv_port,
)

# the engines' tests: four engines and a router start side by side, about a minute on a loaded 2-core machine (past
# the default suite's budget)
slow = pytest.mark.slow

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny random Qwen2.5-VL checkpoint's folder."""
    from tiny_vl import build_tiny_qwen2_5_vl
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    build_tiny_qwen2_5_vl(path, copy.deepcopy(smollm_tokenizer))
    return str(path)


@pytest.fixture(scope="module")
def epd(tmp_path_factory, vl_model):
    """name -> url: encode, encode_corrupt (stages corrupted chunks), prefill, decode engines and the router."""
    tmp = tmp_path_factory.mktemp("epd")
    model = ["serve", vl_model, "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory-gib", "0.05"]
    engines = {"encode": model + transfer_config("kv_producer", abort_request_timeout_s=20),
               "encode_corrupt": model + transfer_config("kv_producer", abort_request_timeout_s=20,
                                                         fault_injection="corrupt_staged"),
               "prefill": model + transfer_config("kv_producer", abort_request_timeout_s=20, transfer_timeout_s=10),
               "decode": model + transfer_config("kv_consumer", transfer_timeout_s=10)}
    with started(engines, tmp, clean=True) as servers:
        urls = {name: server.url for name, server in servers.items()}
        args = router_args([urls["prefill"]], [urls["decode"]], "--encode", urls["encode"])
        with started({"router": args}, tmp, clean=True) as front:
            yield {**urls, "router": front["router"].url}


def images():
    from tiny_vl import png_data_url, random_image
    return [png_data_url(random_image(seed, size)) for seed, size in
            ((1, (80, 120)), (2, (120, 80)), (3, (100, 100)), (4, (64, 96)), (5, (90, 70)), (6, (70, 110)))]


def chat(parts: list, stream: bool = False) -> dict:
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith("data:") else
               {"type": "text", "text": p} for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def answer(url: str, body: dict) -> str:
    if not body["stream"]:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts += [(c.get("delta") or {}).get("content") or "" for c in event["choices"]]
    return "".join(parts)


def settled(url: str, seconds: float = 10.0) -> dict:
    """An engine's metrics once its blocks and staging chunks are all back."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(url)
        if m["kv_cache_usage_perc"] + m["kv_transfer_staging_chunks_used"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@slow
def test_epd_outputs_equal_one_engine_and_the_prefill_engine_never_encodes(epd):
    a, b, c, d, *_ = images()
    batch = [chat([a, "Describe it."]), chat([b, "Describe it."], stream=True), chat([a, "What is in it?"]),
             chat([a, b, "Compare them."]), chat(["First", c, "then", d, "now."], stream=True),
             chat([c, "Describe it."])]
    with ThreadPoolExecutor(3) as pool:
        want = list(pool.map(lambda body: answer(epd["encode"], body), batch))  # one engine alone
        assert len(set(want)) > 1  # the images steer the answers
        before = metrics(epd["decode"])
        got = list(pool.map(lambda body: answer(epd["router"], body), batch))
    assert got == want
    enc, pre, dec = settled(epd["encode"]), settled(epd["prefill"]), settled(epd["decode"])
    # the decode engine computed one prompt token per request (the last, not sent) and no image's rows
    assert source(dec, "local_compute") - source(before, "local_compute") == len(batch)
    assert pre["mm_encoder_runs_total"] == 0 and dec["mm_encoder_runs_total"] == 0
    assert pre["kv_transfer_media_received_total"] >= 4 and pre["kv_transfer_media_failed_reads_total"] == 0
    assert enc["kv_transfer_media_staged_total"] >= pre["kv_transfer_media_received_total"]
    assert enc["mm_encoder_runs_total"] == 4  # each distinct image once (the reference run and the encode requests)
    for m in (enc, pre, dec):
        assert m["kv_cache_usage_perc"] == 0 and m["kv_transfer_staging_chunks_used"] == 0


@slow
def test_a_corrupted_encoder_output_is_encoded_locally_with_the_same_output(epd):
    image = images()[4]
    body = chat([image, "Describe this one."])
    want = answer(epd["encode"], body)
    before = metrics(epd["prefill"])
    encoded = httpx.post(epd["encode_corrupt"] + "/v1/chat/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_encode": True}})
    assert encoded.status_code == 200, encoded.text
    encoder_params = encoded.json()["kv_transfer_params"]
    assert len(encoder_params["media"]) == 1
    prefilled = httpx.post(epd["prefill"] + "/v1/chat/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "remote_encoder": encoder_params}})
    assert prefilled.status_code == 200, prefilled.text
    got = answer(epd["decode"], {**body, "kv_transfer_params": prefilled.json()["kv_transfer_params"]})
    assert got == want
    after = settled(epd["prefill"])
    assert after["kv_transfer_media_failed_reads_total"] == before["kv_transfer_media_failed_reads_total"] + 1
    assert after["kv_transfer_corrupt_chunks_total"] > before["kv_transfer_corrupt_chunks_total"]
    assert after["mm_encoder_runs_total"] == before["mm_encoder_runs_total"] + 1  # the image encoded here instead
    assert after["kv_transfer_media_received_total"] == before["kv_transfer_media_received_total"]
    assert settled(epd["encode_corrupt"])["kv_transfer_staging_chunks_used"] == 0  # the prefill's word let them go


@slow
def test_with_no_healthy_encode_engine_the_prefill_engine_encodes(epd, tmp_path):
    image = images()[5]  # one no engine has seen
    body = chat([image, "Without an encoder."])
    want = answer(epd["encode"], body)
    before = metrics(epd["prefill"])
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = router_args([epd["prefill"]], [epd["decode"]], "--encode", dead)
    with started({"router": args}, tmp_path) as front:
        assert answer(front["router"].url, body) == want
    after = settled(epd["prefill"])
    assert after["kv_transfer_media_received_total"] == before["kv_transfer_media_received_total"]
    assert after["kv_transfer_media_failed_reads_total"] == before["kv_transfer_media_failed_reads_total"]
    assert after["mm_encoder_runs_total"] == before["mm_encoder_runs_total"] + 1


@slow
def test_an_unreachable_encoder_is_waited_for_without_blocking_others_then_encoded_locally(epd):
    body = chat([images()[4], "An unreachable encoder."])
    want = answer(epd["encode"], body)
    encoded = httpx.post(epd["encode"] + "/v1/chat/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_encode": True}})
    params = {**encoded.json()["kv_transfer_params"], "remote_engine_id": "nowhere", "remote_port": free_port()}
    before = metrics(epd["prefill"])
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        waiting = pool.submit(answer, epd["prefill"], {**body, "kv_transfer_params": {"remote_encoder": params}})
        time.sleep(1)
        text = chat(["Meanwhile, a text-only question."])
        assert answer(epd["prefill"], text) == answer(epd["encode"], text)
        assert not waiting.done()  # still waiting for the encoder's metadata (transfer_timeout_s is 10)
        assert waiting.result() == want
        assert 9 < time.monotonic() - start < 60
    after = settled(epd["prefill"])
    assert after["kv_transfer_media_failed_reads_total"] == before["kv_transfer_media_failed_reads_total"] + 1


@slow
def test_foreign_encoder_params_are_refused(epd):
    body = chat([images()[0], "Describe it."])
    bad = {"do_remote_decode": True, "remote_encoder": {"remote_engine_id": "x", "media": []}}
    response = httpx.post(epd["prefill"] + "/v1/chat/completions", timeout=30,
                          json={**body, "kv_transfer_params": bad})
    assert response.status_code == 400 and "remote_encoder lacks" in response.json()["error"]["message"]
    response = httpx.post(epd["decode"] + "/v1/chat/completions", timeout=30,
                          json={**body, "kv_transfer_params": {"do_remote_encode": True}})
    assert response.status_code == 400 and "kv_role is kv_consumer" in response.json()["error"]["message"]


# ---- the parts, without processes ----

def test_encoder_rows_round_trip_through_staging_chunks_without_an_encoder_run():
    import torch

    from pressroom.distributed.kv_transfer.worker_side import KVConnectorWorker
    from pressroom.multimodal.encoder_cache import EncoderCache
    slab = torch.zeros((8, 2, 3, 5), dtype=torch.bfloat16)  # chunks of 60 bytes
    side = KVConnectorWorker(copier=None, slab=slab)
    encoder, prefill = EncoderCache(1000), EncoderCache(1000)
    rows = torch.randn(7, 9)  # 252 bytes: five chunks, the last one part full
    encoder.put("img", rows)
    assert side.media_shapes(encoder, ["img", "gone"]) == [((7, 9), "float32"), None]
    side.save_media(encoder, [("img", [6, 0, 3, 1, 4])])
    side.load_media(prefill, [("img", [6, 0, 3, 1, 4], (7, 9), "float32")], "cpu")
    assert torch.equal(prefill.get("img"), rows)
    assert prefill.encoder_runs == 0 and prefill.received == 1 and encoder.encoder_runs == 1


def test_router_sends_media_requests_to_the_encoder_and_its_params_to_the_prefill_engine():
    from pressroom.entrypoints.router import encode_body, has_media, prefill_body
    body = chat([images()[0], "Describe it."], stream=True)
    assert has_media(body) and not has_media(chat(["text only"]))
    assert encode_body(body)["kv_transfer_params"] == {"do_remote_encode": True}
    assert encode_body(body)["max_tokens"] == 1 and not encode_body(body)["stream"]
    params = {"remote_engine_id": "e", "media": []}
    assert prefill_body(body, params)["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_encoder": params}
    assert "remote_encoder" not in prefill_body(body)["kv_transfer_params"]


@pytest.mark.parametrize("params, message", [
    ({"remote_encoder": {"media": []}}, "remote_encoder lacks remote_engine_id"),
    ({"remote_encoder": "x"}, "remote_encoder must be a JSON object"),
    ({"do_remote_encode": True}, "kv_role is kv_consumer"),
])
def test_encoder_params_this_engine_cannot_serve_are_refused(params, message):
    from pressroom.config import KVTransferConfig
    from pressroom.distributed.kv_transfer.base import check_kv_transfer_params
    consumer = KVTransferConfig.from_value({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match=message):
        check_kv_transfer_params(params, consumer, 16)
    with pytest.raises(ValueError, match="runs no KV connector"):
        check_kv_transfer_params({"do_remote_encode": True}, None, 16)


def offline(model: str, role: str):
    from pressroom import LLM

    def build(port: int) -> LLM:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": port, "kv_buffer_size": 8 << 20,
                  "kv_connector_extra_config": {"transfer_timeout_s": 10}}
        return LLM(model, dtype="float32", kv_cache_memory_gib=0.02, kv_transfer_config=json.dumps(config))
    return with_free_kv_port(build)


def test_offline_encode_then_prefill_reads_the_rows_and_an_evicted_entry_is_encoded_again_to_stage(vl_model):
    """Two offline engines in this process: the prefill engine's tokens with the encode engine's rows equal its own
    without them, and its encoder does not run; an encode engine whose cache lost the rows (evicted; its prefix
    cache covers the image's tokens, so its prefill does not encode) encodes them again to stage them."""
    from pressroom import SamplingParams
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images()[0]}},
                                             {"type": "text", "text": "Describe it."}]}]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    stage = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_encode": True}})
    with offline(vl_model, "kv_producer") as encoder, offline(vl_model, "kv_producer") as prefill:
        want = encoder.chat(messages, greedy, use_tqdm=False)[0].outputs[0].token_ids  # one engine alone
        cache = encoder.engine.runner.multimodal.cache
        cache._entries.clear()  # evicted (no request holds it)
        cache._rows, runs = 0, cache.encoder_runs
        staged = encoder.chat(messages, stage, use_tqdm=False)[0]
        params, ids = staged.kv_transfer_params, staged.prompt_token_ids
        pad = max(set(ids), key=ids.count)  # the image's placeholder run: its prefill did not reach it
        assert ids.count(pad) == params["media"][0]["shape"][0]
        assert staged.num_cached_tokens >= len(ids) - ids[::-1].index(pad)
        assert cache.encoder_runs == runs + 1 and len(params["media"]) == 1
        read = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              extra_args={"kv_transfer_params": {"remote_encoder": params}})
        got = prefill.chat(messages, read, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        mm = prefill.engine.runner.multimodal.cache
        assert mm.encoder_runs == 0 and mm.received == 1
        stats = prefill.engine.core.stats().kv_transfer
        assert stats.media_received == 1 and stats.media_failed == 0
