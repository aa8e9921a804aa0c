"""Data parallelism: two engine cores behind one server (real processes, the openai client). 256 concurrent
streams keep both busy (per-engine metrics); a request pinned by header or field goes to that core alone; a
rank out of range is a 400."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import tiny_args
from prometheus_client.parser import text_string_to_metric_families
from serving import serve

FILLER = "and then the quick brown fox jumps over the lazy dog " * 3  # two full blocks of 16 tokens


def per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    # with KV offload: each engine core has a CPU tier of its own
    args = tiny_args(tiny_model_dir("llama"), "--data-parallel-size", "2", "--kv-offloading-size", "0.01")
    with serve(args, tmp_path_factory.mktemp("dp") / "server.log") as (url, _):
        yield url


def test_256_streams_keep_both_engines_busy(dp_server):
    client = openai.AsyncOpenAI(base_url=f"{dp_server}/v1", api_key="none", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=300)))

    model = httpx.get(f"{dp_server}/v1/models").json()["data"][0]["id"]

    async def one(i: int) -> str:
        stream = await client.completions.create(model=model, prompt=f"request {i} says {FILLER}", max_tokens=4,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(256)))

    before = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    texts = asyncio.run(run())
    assert len(texts) == 256 and all(texts)
    after = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    served = {e: after[e] - before.get(e, 0) for e in after}
    assert set(served) == {"0", "1"}
    assert min(served.values()) > 0.3 * sum(served.values()), served  # both cores took a fair share
    # each core asked its own CPU tier for the prompts' full blocks
    asked = per_engine(dp_server, "vllm:kv_offload_tiering_chunk_queries_total")
    assert set(asked) == {"0", "1"} and min(asked.values()) > 0, asked


@pytest.mark.parametrize("how", ["header", "field"])
def test_a_pinned_request_goes_to_its_engine(dp_server, how):
    before = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    pin = {"headers": {"X-data-parallel-rank": "1"}} if how == "header" else {"json_extra": {"data_parallel_rank": 1}}
    for i in range(6):
        body = {"prompt": f"pinned {i} of {how}", "max_tokens": 2} | pin.get("json_extra", {})
        r = httpx.post(f"{dp_server}/v1/completions", json=body, headers=pin.get("headers"), timeout=60)
        assert r.status_code == 200, r.text
    after = per_engine(dp_server, "vllm:prefix_cache_queries_total")
    assert after["0"] == before["0"] and after["1"] > before["1"]


@pytest.mark.parametrize("rank", ["2", "-1", "x"])
def test_a_rank_out_of_range_is_a_400(dp_server, rank):
    r = httpx.post(f"{dp_server}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"X-data-parallel-rank": rank}, timeout=30)
    assert r.status_code == 400 and "data_parallel_rank" in r.text.replace("X-data-parallel-rank", "data_parallel_rank")
    r = httpx.post(f"{dp_server}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "data_parallel_rank": 5})
    assert r.status_code == 400 and "data_parallel_rank" in r.json()["error"]["message"]
