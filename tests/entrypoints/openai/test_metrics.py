"""/metrics as vLLM 0.32 exports it. ServerMetrics on output streams: request_success_total counts requests (not
choices), labelled with vLLM's finished_reason; a request that ends without a final output (its client left, the
engine ended it) counts as "abort", one whose output handling failed as "error"; a request's counts and intervals.
A real server (one sequence at a time, so a second request waits): every family of the target list present with
model_name and engine labels and vLLM's buckets; queue time ends at the first scheduling, not at the first
token."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import httpx
import openai
import pytest
from conftest import tiny_args
from prometheus_client.parser import text_string_to_metric_families
from serving import serve

from pressroom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pressroom.core.scheduler import ITERATION_TOKENS_BUCKETS, SchedulerStats
from pressroom.engine.async_engine import EngineDeadError
from pressroom.engine.step_cost import ModelShape, RequestStep, StepCost, estimate, request_steps
from pressroom.entrypoints.openai.metrics import (
    ADMISSION_FAMILY,
    HTTP_HIGHR_BUCKETS,
    PREEMPTION_BUCKETS,
    REQUEST_TIME_BUCKETS,
    TARGET,
    TTFT_BUCKETS,
    EngineShape,
    ServerMetrics,
    count_buckets,
)
from pressroom.model.loader import load_hf_config
from pressroom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pressroom.sampling_params import SamplingParams


def _out(reasons: list[str | None], tokens: int) -> RequestOutput:
    finished = all(r is not None for r in reasons)
    choices = [CompletionOutput(i, "x" * tokens, [7] * tokens, finish_reason=r) for i, r in enumerate(reasons)]
    return RequestOutput("r", "p", [1, 2, 3], choices, finished, metrics=RequestMetrics(time.monotonic()))


async def _stream(outputs: list[RequestOutput], error: BaseException | None = None):
    for out in outputs:
        yield out
    if error is not None:
        raise error


def _success(metrics: ServerMetrics, reason: str) -> float:
    return _sample(metrics, "vllm:request_success_total", finished_reason=reason)


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0


async def _drain(stream) -> None:
    async with aclosing(stream):
        async for _ in stream:
            pass


def test_request_success_counts_requests_not_choices():
    metrics = ServerMetrics("m", log_requests=False)
    n3 = [_out([None, None, None], 1), _out(["length", "stop", "length"], 4)]  # one request, n=3
    asyncio.run(_drain(metrics.observe(_stream(n3))))
    assert _success(metrics, "length") == 1 and _success(metrics, "stop") == 0  # its first choice's reason
    assert _sample(metrics, "vllm:generation_tokens_total") == 12
    assert _sample(metrics, "vllm:prompt_tokens_total") == 3


def test_abandoned_and_ended_requests_count_as_abort_and_failed_ones_as_error():
    metrics = ServerMetrics("m", log_requests=False)

    async def main():
        left = metrics.observe(_stream([_out([None], 1), _out([None], 2), _out(["length"], 3)]))
        await left.__anext__()
        await left.aclose()  # the client went away mid-stream
        with pytest.raises(EngineDeadError):  # the engine ended it (shutdown's grace period over, a dead core)
            await _drain(metrics.observe(_stream([_out([None], 1)], EngineDeadError("gone"))))
        await _drain(metrics.observe(_stream([_out(["error", "error"], 2)])))  # its output handling failed
        await _drain(metrics.observe(_stream([_out(["abort"], 2)])))  # finished by an abort the engine reported

    asyncio.run(main())
    assert _success(metrics, "abort") == 3 and _success(metrics, "error") == 1 and _success(metrics, "length") == 0
    total = sum(s.value for family in metrics.registry.collect() for s in family.samples
                if s.name == "vllm:request_success_total")
    assert total == 4  # one count per request, whatever happened to it


def test_a_finished_request_is_counted_and_timed_under_its_engine():
    metrics = ServerMetrics("m", log_requests=False, shape=EngineShape(max_model_len=100, num_engines=2))
    times = RequestMetrics(10.0, first_scheduled_time=10.5, first_token_time=11.0, last_token_time=13.0,
                           finished_time=13.5, engine_index=1, num_preemptions=2)
    choices = [CompletionOutput(0, "x", [7] * 5, finish_reason="length"), CompletionOutput(1, "y", [7] * 3,
                                                                                          finish_reason="stop")]
    out = RequestOutput("r", "p", list(range(40)), choices, True, num_cached_tokens=32, metrics=times)
    asyncio.run(_drain(metrics.observe(_stream([out]), SamplingParams(n=2, max_tokens=5))))

    def one(name: str, engine: str = "1", **labels: str) -> float | None:
        return metrics.registry.get_sample_value("vllm:" + name, {"model_name": "m", "engine": engine, **labels})

    seconds = {"request_queue_time_seconds": 0.5, "request_prefill_time_seconds": 0.5,
               "request_decode_time_seconds": 2.0, "request_inference_time_seconds": 2.5,
               "e2e_request_latency_seconds": 3.5, "time_to_first_token_seconds": 1.0,
               "request_time_per_output_token_seconds": 0.5}  # decode over the longest sample's 4 later tokens
    counts = {"request_prompt_tokens": 40, "request_generation_tokens": 8, "request_max_num_generation_tokens": 5,
              "request_params_n": 2, "request_params_max_tokens": 5, "request_prefill_kv_computed_tokens": 8,
              "request_num_preemptions": 2}
    for name, value in {**seconds, **counts}.items():
        assert (one(name + "_count"), one(name + "_sum")) == (1, value), name
        assert one(name + "_count", engine="0") == 0, name  # the other engine's series, there from the start
    assert one("prompt_tokens_total") == 40 and one("prompt_tokens_cached_total") == 32
    assert [one("prompt_tokens_by_source_total", source=s) for s in
            ("local_compute", "local_cache_hit", "external_kv_transfer")] == [8, 32, 0]
    assert [one("prompt_tokens_cached_by_source_total", source=s) for s in
            ("device", "host", "p2p", "disk", "external_unspecified")] == [32, 0, 0, 0, 0]
    assert one("request_success_total", finished_reason="length") == 1
    assert one("request_prompt_tokens_bucket", le="20.0") == 0 and one("request_prompt_tokens_bucket", le="50.0") == 1


def test_scheduler_figures_are_read_from_each_cores_stats_at_scrape_time():
    metrics = ServerMetrics("m", log_requests=False, shape=EngineShape(num_engines=2))
    steps = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    steps[0], steps[ITERATION_TOKENS_BUCKETS.index(512)], steps[-1] = 3, 1, 1  # 1, 1, 1, 300 and 20,000 tokens
    busy = SchedulerStats(num_running=2, num_waiting=5, num_waiting_deferred=2, iteration_tokens=steps,
                          iteration_tokens_sum=20_303, external_prefix_cache_queries=64,
                          external_prefix_cache_hits=48)
    families = {f.name: f for f in text_string_to_metric_families(
        metrics.render([SchedulerStats(), busy]).decode())}

    def value(name: str, engine: str = "1", sample: str | None = None, **labels: str) -> float:
        matches = [s.value for s in families["vllm:" + name].samples if s.name == "vllm:" + (sample or name)
                   and s.labels == {"model_name": "m", "engine": engine, **labels}]
        assert len(matches) == 1, (name, labels)
        return matches[0]

    assert value("num_requests_waiting_by_reason", reason="capacity") == 3
    assert value("num_requests_waiting_by_reason", reason="deferred") == 2
    assert value("num_requests_waiting_by_reason", engine="0", reason="capacity") == 0
    cumulative = [value("iteration_tokens_total", sample="iteration_tokens_total_bucket", le=le)
                  for le in ("1.0", "256.0", "512.0", "16384.0", "+Inf")]
    assert cumulative == [3, 3, 4, 4, 5]
    assert value("iteration_tokens_total", sample="iteration_tokens_total_sum") == 20_303
    assert value("external_prefix_cache_queries", sample="external_prefix_cache_queries_total") == 64
    assert value("external_prefix_cache_hits", sample="external_prefix_cache_hits_total") == 48
    assert value("mm_cache_queries", sample="mm_cache_queries_total") == 0
    def sleep_state(engine: str) -> list[float]:
        return [value("engine_sleep_state", engine, sleep_state=s) for s in ("awake", "weights_offloaded",
                                                                            "discard_all")]

    assert sleep_state("0") == sleep_state("1") == [1, 0, 0]
    for sleeping, level, expected in ((True, 1, [0, 1, 0]), (True, 2, [0, 0, 1]), (True, 0, [0, 0, 0])):
        asleep = SchedulerStats(sleeping=sleeping, sleep_level=level)
        families = {f.name: f for f in text_string_to_metric_families(metrics.render([asleep, busy]).decode())}
        assert sleep_state("0") == expected and sleep_state("1") == [1, 0, 0]


def test_http_requests_are_counted_by_route_template_method_and_status_class():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    app = FastAPI()
    metrics = ServerMetrics("m", log_requests=False)
    metrics.instrument(app)

    @app.post("/v1/items/{item}")
    async def item(item: int) -> dict:
        return {"item": item}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(iter([b"ab", b"cde"]))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
            assert (await http.post("/v1/items/7", content=b"{}")).status_code == 200
            assert (await http.post("/v1/items/x")).status_code == 422
            assert (await http.get("/nowhere")).status_code == 404
            assert (await http.get("/health")).status_code == 200  # not counted, as vLLM's /health
            assert (await http.get("/stream")).text == "abcde"

    asyncio.run(main())
    value = metrics.registry.get_sample_value
    assert value("http_requests_total", {"handler": "/v1/items/{item}", "method": "POST", "status": "2xx"}) == 1
    assert value("http_requests_total", {"handler": "/v1/items/{item}", "method": "POST", "status": "4xx"}) == 1
    assert value("http_requests_total", {"handler": "none", "method": "GET", "status": "4xx"}) == 1
    assert value("http_requests_total", {"handler": "/health", "method": "GET", "status": "2xx"}) is None
    assert value("http_request_size_bytes_sum", {"handler": "/v1/items/{item}"}) == 2
    assert value("http_response_size_bytes_sum", {"handler": "/stream"}) == 5
    assert value("http_request_duration_highr_seconds_count", {}) == 4
    assert value("http_request_duration_seconds_count", {"handler": "/stream", "method": "GET"}) == 1
    bounds = [float(s.labels["le"]) for family in metrics.registry.collect() for s in family.samples
              if s.name == "http_request_duration_highr_seconds_bucket"]
    assert bounds == [*HTTP_HIGHR_BUCKETS, float("inf")]


# ---- a real server, one sequence at a time ----

def _families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}


def _sums(url: str) -> dict[str, float]:
    """The queue-time and TTFT histograms' sums and counts, over every series."""
    families = _families(url)
    return {f"{name}{suffix}": sum(s.value for s in families[f"vllm:{name}"].samples if s.name.endswith(suffix))
            for name in ("request_queue_time_seconds", "time_to_first_token_seconds") for suffix in ("_sum", "_count")}


def _since(url: str, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _sums(url).items()}


@pytest.fixture(scope="module")
def one_seq_server(tiny_model_dir, tmp_path_factory):
    """The tiny llama serving one sequence at a time (a second request waits for the first to finish), under
    vLLM's prefix, with ngram drafts (the spec_decode families) and --enable-mfu-metrics (the estimates)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "adaptive_token_budget": False})
    args = tiny_args(tiny_model_dir("llama"), "--max-num-seqs", "1", "--speculative-config", spec,
                     "--enable-mfu-metrics")
    with serve(args, tmp_path_factory.mktemp("one-seq") / "server.log") as (url, _):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_every_family_has_model_name_and_engine_labels_and_vllm_buckets(one_seq_server):
    url, client = one_seq_server
    client.completions.create(model="tiny", prompt="one two one two one two", max_tokens=6, n=2,
                              extra_body={"ignore_eos": True})
    families = _families(url)
    missing = [name for name in TARGET if "vllm:" + name not in families]
    assert not missing
    for name in TARGET:
        samples = families["vllm:" + name].samples
        assert samples and all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0" for s in samples), name

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families["vllm:" + name].samples if s.name.endswith("_bucket")]

    max_model_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    assert bounds("time_to_first_token_seconds") == [*TTFT_BUCKETS, float("inf")]
    assert bounds("request_queue_time_seconds") == [*REQUEST_TIME_BUCKETS, float("inf")]
    assert bounds("request_prompt_tokens") == [*count_buckets(max_model_len), float("inf")]
    assert bounds("request_num_preemptions") == [1, 2, 3, 4, 5, 10, 20, float("inf")] == [*PREEMPTION_BUCKETS,
                                                                                          float("inf")]
    assert bounds("iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                float("inf")]
    steps = [s.value for s in families["vllm:iteration_tokens_total"].samples if s.name.endswith("_count")]
    assert steps[0] >= 6  # the prompt's step, then one per token at least (drafts make steps longer, not more)
    waiting = {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"].samples}
    assert set(waiting) == {"capacity", "deferred"}
    assert sum(waiting.values()) == families["vllm:num_requests_waiting"].samples[0].value
    awake = {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"].samples}
    assert awake == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    n = [s.value for s in families["vllm:request_params_n"].samples if s.name.endswith("_sum")]
    assert n and n[0] >= 2  # the n=2 request
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
    assert any(s.labels == {"handler": "/v1/completions", "method": "POST", "status": "2xx"} and s.value >= 1
               for s in families["http_requests"].samples)
    assert {"process_resident_memory_bytes", "python_gc_objects_collected", "http_request_duration_highr_seconds",
            "http_request_duration_seconds", "http_request_size_bytes", "http_response_size_bytes"} <= set(families)


LONG_PROMPT = " ".join(f"word{i}" for i in range(300))


def test_queue_time_ends_at_first_scheduling_not_at_first_token(one_seq_server):
    url, client = one_seq_server
    # Alone: scheduled at once; its first token waits for the prefill of a long prompt.
    before = _sums(url)
    client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=1)
    alone = _since(url, before)
    assert alone["request_queue_time_seconds_count"] == 1
    assert alone["request_queue_time_seconds_sum"] < alone["time_to_first_token_seconds_sum"] / 2, alone
    assert alone["request_queue_time_seconds_sum"] < 0.25, alone  # ~0: the idle core schedules it at once
    # Behind another: sent once the first has streamed a token, the second waits until the first has finished.
    before = _sums(url)
    first = client.completions.create(model="tiny", prompt="Hi", max_tokens=64, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(first))
    sent = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(client.completions.create, model="tiny", prompt="Hello", max_tokens=2)
        for _ in first:
            pass
        waited = time.monotonic() - sent
        second.result()
    both = _since(url, before)
    assert both["request_queue_time_seconds_count"] == 2
    assert both["request_queue_time_seconds_sum"] > waited / 2, (both, waited)  # the second's wait
    assert both["request_queue_time_seconds_sum"] < both["time_to_first_token_seconds_sum"], both


# ---- vLLM's MFU estimates (--enable-mfu-metrics) and admission rejections ----

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, feed-forward 16, vocabulary 32; 2 bytes for everything
TINY_SHAPE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                        vocab_size=32, weight_bytes=2, activation_bytes=2, kv_bytes=2)


def test_a_steps_estimate_is_the_hand_computed_one():
    """A 3-token prefill (nothing computed before) beside a 1-token decode after 5, worked out by hand: per layer
    four matrix multiplies over the step's 4 rows, attention over each request's context at the step's end."""
    steps = [RequestStep(3, 0, 1), RequestStep(1, 5, 1)]
    # (weight in, out): qkv (8, 16), o (8, 8), gate+up (8, 32), down (16, 8)
    matmul_flops = 2 * 4 * (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8)  # 4608
    matmul_read = 2 * (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8) + 2 * 4 * (8 + 8 + 8 + 16)  # weights + input rows: 1472
    matmul_write = 2 * 4 * (16 + 8 + 32 + 8)  # output rows: 512
    # QK^T and PV: 2 heads x 4 dims, 3 tokens x context 3 and 1 token x context 6
    attn_flops = 2 * 2 * 2 * 4 * (3 * 3 + 1 * 6)  # 480
    attn_read = 2 * (4 * 2 * 4) + 2 * 2 * (3 + 6) * 1 * 4  # queries of 4 tokens + K and V over contexts 3 and 6: 208
    attn_write = 2 * (4 * 2 * 4) + 2 * 2 * 4 * 1 * 4  # outputs + K and V of the 4 new tokens: 128
    # LM head over the 2 sampled rows: (8, 32)
    head = StepCost(2 * 2 * 8 * 32, 2 * 8 * 32 + 2 * 2 * 8, 2 * 2 * 32)
    expected = StepCost(2 * (matmul_flops + attn_flops), 2 * (matmul_read + attn_read),
                        2 * (matmul_write + attn_write)) + head
    assert expected == StepCost(11200, 3904, 1408)
    assert estimate(steps, TINY_SHAPE) == expected
    assert estimate([], TINY_SHAPE) == StepCost()


def test_experts_bill_their_top_k_rows_and_the_weights_those_rows_reach():
    """One MoE layer (4 experts of width 4, top 2), 1 byte for everything, worked out by hand."""
    moe = ModelShape(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=0,
                     num_moe_layers=1, num_experts=4, experts_per_token=2, expert_intermediate_size=4,
                     vocab_size=32, weight_bytes=1, activation_bytes=1, kv_bytes=1)
    one = estimate([RequestStep(1, 0, 1)], moe)
    # qkv (8, 16), o (8, 8); 2 routed rows through gate+up (8, 8) and down (4, 8); QK and PV over 1; head (8, 32)
    assert one.flops == 2 * (8 * 16 + 8 * 8) + 2 * 2 * (8 * 8 + 4 * 8) + 2 * 2 * 2 * 4 + 2 * 8 * 32
    # weights (2 experts reached) + input rows, per multiply; queries and K, V of the context; the head's
    assert one.read_bytes == (8 * 16 + 8) + (8 * 8 + 8) + (2 * 8 * 8 + 2 * 8) + (2 * 4 * 8 + 2 * 4) + (8 + 8) \
        + (8 * 32 + 8)
    # 8 tokens: 16 routed rows reach all 4 experts, whose weights are read once
    many = estimate([RequestStep(8, 0, 1)], moe)
    assert many.read_bytes == (8 * 16 + 64) + (8 * 8 + 64) + (4 * 8 * 8 + 16 * 8) + (4 * 4 * 8 + 16 * 4) \
        + (64 + 2 * 8 * 4) + (8 * 32 + 8)


def test_moe_configs_give_their_experts():
    from transformers import AutoConfig
    qwen = AutoConfig.for_model("qwen2_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=128)
    shape = ModelShape.from_hf_config(qwen, tp_size=2, weight_bytes=2, activation_bytes=2, kv_bytes=2)
    assert (shape.num_moe_layers, shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size,
            shape.shared_intermediate_size, shape.intermediate_size) == (2, 8, 2, 16, 32, 0)
    deepseek = AutoConfig.for_model("deepseek_v3", num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8,
                                    n_shared_experts=1, moe_intermediate_size=32, intermediate_size=128)
    shape = ModelShape.from_hf_config(deepseek, weight_bytes=2, activation_bytes=2, kv_bytes=2)
    assert (shape.num_moe_layers, shape.intermediate_size, shape.shared_intermediate_size) == (3, 128, 32)


def test_a_scheduled_steps_requests_with_their_context_and_sampled_rows():
    sched = SchedulerOutput(
        new_requests=[NewRequestData("a", list(range(10)), 10, SamplingParams(), [0], num_computed_tokens=4)],
        cached_requests=[CachedRequestData("b", [], 7), CachedRequestData("c", [], 20),
                         CachedRequestData("d", [], 3), CachedRequestData("idle", [], 9)],
        num_scheduled_tokens={"a": 6, "b": 1, "c": 3, "d": 5}, total_num_scheduled_tokens=15,
        scheduled_spec_decode_tokens={"c": [5, 6]})
    assert request_steps(sched) == [RequestStep(6, 4, 1), RequestStep(1, 7, 1), RequestStep(3, 20, 3),
                                    RequestStep(5, 3, 1)]  # a chunk, a decode, a verify of 2 drafts, a chunk


def test_the_tiny_llamas_shape_from_its_config(tiny_model_dir):
    config = load_hf_config(tiny_model_dir("llama"))
    shape = ModelShape.from_hf_config(config, tp_size=1, weight_bytes=4, activation_bytes=4, kv_bytes=4)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size,
            shape.vocab_size) == (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                  config.num_key_value_heads, config.intermediate_size, config.vocab_size)
    assert shape.head_dim == getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    split = ModelShape.from_hf_config(config, tp_size=2, weight_bytes=4, activation_bytes=4, kv_bytes=4)
    assert (split.num_heads, split.vocab_size) == (max(1, shape.num_heads // 2), shape.vocab_size // 2)


def _estimated(url: str) -> StepCost:
    families = _families(url)
    value = [families[f"vllm:estimated_{kind}_per_gpu"].samples[0].value for kind in ("flops", "read_bytes",
                                                                                     "write_bytes")]
    return StepCost(*(int(v) for v in value))


def test_mfu_counters_move_by_the_estimate_of_a_requests_steps(one_seq_server, tiny_model_dir):
    """A request of one token is one step: its prompt, nothing computed before (a prompt no other test sends),
    one row sampled. The counters move by that step's estimate for the tiny llama in float32."""
    url, client = one_seq_server
    before = _estimated(url)
    reply = client.completions.create(model="tiny", prompt="zebra quasar mauve lattice", max_tokens=1)
    prompt = reply.usage.prompt_tokens
    shape = ModelShape.from_hf_config(load_hf_config(tiny_model_dir("llama")), weight_bytes=4, activation_bytes=4,
                                      kv_bytes=4)
    step = estimate([RequestStep(prompt, 0, 1)], shape)
    after = _estimated(url)
    assert step.flops > 0 and StepCost(after.flops - before.flops, after.read_bytes - before.read_bytes,
                                       after.write_bytes - before.write_bytes) == step


def test_without_the_flag_the_estimates_are_there_at_zero_and_admission_rejections_by_reason():
    metrics = ServerMetrics("m", log_requests=False, shape=EngineShape(num_engines=2))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render([SchedulerStats()] * 2).decode())}
    for kind in ("flops", "read_bytes", "write_bytes"):
        samples = families[f"vllm:estimated_{kind}_per_gpu"].samples
        assert [(s.labels, s.value) for s in samples] == [({"model_name": "m", "engine": e}, 0) for e in "01"]
        assert families[f"vllm:estimated_{kind}_per_gpu"].type == "counter"
    rejections = families["vllm:" + ADMISSION_FAMILY]
    assert rejections.type == "counter"
    assert [(s.labels, s.value) for s in rejections.samples] == [
        ({"model_name": "m", "reason": r}, 0) for r in ("max_num_queued_reqs", "max_num_queued_tokens")]
