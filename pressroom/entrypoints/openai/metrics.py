"""Prometheus metrics under vLLM 0.32's names (`vllm:` prefix), labels and buckets, so a vLLM dashboard reads them
unchanged.

The families (TARGET below), each labelled `model_name` and `engine` (the index of the data-parallel engine core,
"0" with one), as vLLM's `PrometheusStatLogger` exports them:
- scheduler state, each core's snapshot read at scrape time: num_requests_running, num_requests_waiting,
  num_requests_waiting_by_reason (+ reason: capacity, or deferred by a sibling's prompt, a grammar compiling,
  --max-loras adapters running, KV on its way), kv_cache_usage_perc, engine_sleep_state (+ sleep_state: awake,
  or asleep at level 1 weights_offloaded or 2 discard_all; all 0 while only paused) (gauges);
  num_preemptions, prefix_cache_queries, prefix_cache_hits, external_prefix_cache_queries and
  external_prefix_cache_hits (a KV connector's lookups), mm_cache_queries and mm_cache_hits (no multi-modal
  processor cache: 0) (counters); iteration_tokens_total (tokens scheduled per engine step; a histogram); with
  speculative decoding, spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens and
  spec_decode_num_accepted_tokens_per_pos (+ position) (counters);
- requests, observed on their output streams: prompt_tokens, generation_tokens, prompt_tokens_cached,
  prompt_tokens_by_source (+ source) and prompt_tokens_cached_by_source (+ source) (both without KV offload tiers,
  whose hits cannot be told from the device's per request), request_success (+ finished_reason) (counters);
  request_prompt_tokens, request_generation_tokens, request_max_num_generation_tokens, request_params_max_tokens
  and request_prefill_kv_computed_tokens (1-2-5 buckets up to max_model_len), request_params_n,
  request_num_preemptions, time_to_first_token_seconds, inter_token_latency_seconds,
  request_time_per_output_token_seconds, e2e_request_latency_seconds, request_queue_time_seconds,
  request_inference_time_seconds, request_prefill_time_seconds and request_decode_time_seconds (histograms);
- cache_config_info, a gauge of 1 whose labels are the cache config; with --enable-lora, lora_requests_info (its
  labels max_lora and the running and waiting requests' adapters, comma-separated; its value the snapshot's time).
Beside them: the KV offload tiers' families (vLLM 0.28's KV offload metrics), with a KV connector (disaggregated
serving) its kv_transfer_* families (bytes and tokens received, reads done and failed, corrupt chunks, bytes staged
and sent, staged requests expired; the staging chunks held), the process's own (process_*,
python_*), as prometheus_client exports them to vLLM's registry, and with `ServerMetrics.instrument(app)` the HTTP
families prometheus_fastapi_instrumentator gives vLLM (http_requests_total, http_request_size_bytes,
http_response_size_bytes, http_request_duration_highr_seconds, http_request_duration_seconds).

admission_rejections (+ reason: max_num_queued_reqs, max_num_queued_tokens; labelled model_name and reason only, as
vLLM's API server counts it) is always 0: pressroom has no such queue bound to reject by. estimated_flops_per_gpu,
estimated_read_bytes_per_gpu and estimated_write_bytes_per_gpu (counters) are each core's per-step estimates from the
model's shape (engine/step_cost.py), counted with --enable-mfu-metrics and 0 without it, as vLLM's.

Left out: time_per_output_token_seconds (vLLM 0.32 shows it only with --show-hidden-metrics-for-version), and the
opt-in ones (kv_block_* residency, corrupted_requests).

A request's intervals are vLLM's: queue = arrival to its first scheduling by the engine core (the core's clock
when it scheduled the step, CoreOutputs.scheduled_time); prefill = that to its first token; decode = first to last
token; inference = scheduling to last token; time per output token = decode over the tokens after the first (the
longest sample's, with n > 1). One observation per request (its n samples together), as request_success counts it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    Summary,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from starlette.applications import Starlette
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pressroom.config import CacheConfig, EngineConfig
from pressroom.core.scheduler import ITERATION_TOKENS_BUCKETS, SchedulerStats
from pressroom.kv_offload.manager import TIME_BUCKETS, OffloadStats
from pressroom.logger import printable
from pressroom.outputs import RequestMetrics, RequestOutput
from pressroom.sampling_params import SamplingParams

logger = logging.getLogger("pressroom")

CONTENT_TYPE = CONTENT_TYPE_LATEST

PREFIX = "vllm:"  # vLLM's, so its dashboards and alerts work unchanged

# vLLM 0.32's families (names without the prefix; counters without _total, as Prometheus parsers name families)
# that this module exports, each with model_name and engine labels; admission_rejections beside them.
TARGET = (
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason", "kv_cache_usage_perc",
    "engine_sleep_state", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    "external_prefix_cache_queries", "external_prefix_cache_hits", "mm_cache_queries", "mm_cache_hits",
    "iteration_tokens_total", "prompt_tokens", "prompt_tokens_by_source", "prompt_tokens_cached",
    "prompt_tokens_cached_by_source", "generation_tokens", "request_success", "request_prompt_tokens",
    "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_prefill_kv_computed_tokens", "request_num_preemptions", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "cache_config_info",
    "estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)
SPEC_FAMILIES = TARGET[-4:]  # exported with speculative decoding on
ADMISSION_FAMILY = "admission_rejections"  # beside TARGET: vLLM labels it model_name and reason, no engine

# vLLM's bucket sets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason (pressroom never repeats)
TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource, nearest first
WAITING_REASONS = ("capacity", "deferred")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # vLLM's queue bounds (flags of its own)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's: awake, or asleep at level 1 or 2
LABELS = ("model_name", "engine")

# No `*_created` series (a creation timestamp beside every counter and histogram): they add a series per
# counter to every scrape with nothing a dashboard plots. prometheus_client's switch is process-wide.
disable_created_metrics()


def count_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts, up to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShape:
    """What the families' buckets and label sets follow. `max_model_len`: the count histograms' buckets run 1, 2,
    5, ... up to it (1, the default: not told, one bucket). `cache_info`: cache_config_info's labels (empty: the
    family is left out). `offload`: KV offload tiers serve part of the cached tokens."""
    max_model_len: int = 1
    num_engines: int = 1
    num_speculative_tokens: int = 0  # 0: no speculative decoding, no spec_decode families
    max_loras: int = 0  # 0: no LoRA adapters, no lora_requests_info
    cache_info: tuple[tuple[str, str], ...] = ()
    offload: bool = False

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> EngineShape:
        spec = config.speculative
        return cls(max_model_len=max_model_len, num_engines=config.parallel.data_parallel_size,
                   num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                   max_loras=config.lora.max_loras if config.lora is not None else 0,
                   cache_info=cache_info(config.cache), offload=config.offload is not None)


_VLLM_CACHE_NAMES = {"num_blocks": "num_gpu_blocks_override"}  # pressroom's field -> vLLM's CacheConfig field
_FP8_NAMES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}  # torch's dtype -> vLLM's cache_dtype


def cache_info(cache: CacheConfig) -> tuple[tuple[str, str], ...]:
    """The cache config as cache_config_info's labels, under vLLM's field names and spellings (None as "None")."""
    def spelled(name: str, value) -> str:
        if name == "cache_dtype":
            dtype = str(value).removeprefix("torch.")
            return "auto" if value is None else _FP8_NAMES.get(dtype, dtype)
        return str(value)
    return tuple((_VLLM_CACHE_NAMES.get(f.name, f.name), spelled(f.name, getattr(cache, f.name)))
                 for f in fields(cache))


class ServerMetrics:
    """`log_requests`: an INFO line per finished engine request (--enable-log-requests). `shape`: the
    engine's (EngineShape.of its config); without it, one engine, no cache_config_info, no spec_decode families."""

    def __init__(self, model_name: str, log_requests: bool = False, shape: EngineShape | None = None) -> None:
        self.model_name, self.log_requests = model_name, log_requests
        self.shape = shape = shape if shape is not None else EngineShape()
        self.engines = [str(i) for i in range(shape.num_engines)]
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.stats: list[SchedulerStats] = [SchedulerStats() for _ in self.engines]
        self.total_prompt_tokens = self.total_generation_tokens = 0  # for the log line
        # Only model_name, engine and a few bounded labels (finished_reason, source, position) label series. A
        # request's session id goes to its log line, never to a label: session ids are unbounded, and one time
        # series per session would grow the registry (and every scrape) without limit.
        self._add_token_counters(shape)
        self._add_request_histograms(count_buckets(shape.max_model_len))
        self._add_latency_histograms()
        self._add_admission_rejections()
        if shape.cache_info:
            self._cache_config_info(dict(shape.cache_info))
        self.registry.register(_SchedulerCollector(self))

    def _add_token_counters(self, shape: EngineShape) -> None:
        """Tokens of finished requests (by source and cache tier without KV offload) and requests by reason."""
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")
        self.prompt_tokens_cached = self._counter("prompt_tokens_cached", "Prompt tokens of finished requests "
                                                  "found computed (prefix cache, KV offload tiers).")
        self.prompt_tokens_by_source = None if shape.offload else self._counter(
            "prompt_tokens_by_source", "Prompt tokens of finished requests by where their KV came from.",
            ("source",), TOKEN_SOURCES)
        self.prompt_tokens_cached_by_source = None if shape.offload else self._counter(
            "prompt_tokens_cached_by_source", "Cached prompt tokens of finished requests by the tier that held "
            "them.", ("source",), CACHE_SOURCES)
        self.request_success = self._counter("request_success", "Finished requests by finish reason.",
                                             ("finished_reason",), FINISH_REASONS)

    def _add_request_histograms(self, counts: list[int]) -> None:
        """Per finished request: its token counts and parameters."""
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens per request.", counts)
        self.request_generation_tokens = self._histogram("request_generation_tokens",
                                                         "Generated tokens per request (its samples together).", counts)
        self.request_max_num_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Generated tokens of a request's longest sample.", counts)
        self.request_params_n = self._histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_num_preemptions = self._histogram("request_num_preemptions",
                                                       "Preemptions per finished request.", PREEMPTION_BUCKETS)
        self.request_params_max_tokens = self._histogram("request_params_max_tokens",
                                                         "The max_tokens request parameter.", counts)
        self.request_prefill_kv_computed_tokens = self._histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens per request computed (not found cached).", counts)

    def _add_latency_histograms(self) -> None:
        """Per finished request: its times, from arrival to finish and each phase's."""
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output tokens.", TOKEN_GAP_BUCKETS)
        self.tpot = self._histogram("request_time_per_output_token_seconds",
                                    "Per request: decode time over the tokens after the first.", TOKEN_GAP_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_TIME_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          REQUEST_TIME_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds", "First scheduled to last token.",
                                              REQUEST_TIME_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                            REQUEST_TIME_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds", "First token to last token.",
                                           REQUEST_TIME_BUCKETS)

    def _add_admission_rejections(self) -> None:
        """vLLM's family, present from the start (pressroom rejects nothing by a queue bound)."""
        # vLLM's admission_rejections: labelled by model_name and reason only (its API server counts them, not an
        # engine core)
        self.admission_rejections = Counter(
            PREFIX + ADMISSION_FAMILY, "Admission attempts rejected by a queue limit, by reason (pressroom "
            "has no --max-num-queued-reqs or --max-num-queued-tokens bound: always 0).", ["model_name", "reason"],
            registry=self.registry)
        for reason in ADMISSION_REASONS:  # vLLM's series, there from the start
            self.admission_rejections.labels(self.model_name, reason)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = (), values: tuple[str, ...] = ()) -> Counter:
        """A counter with a series per engine (and per value of its one extra label) from the start, as vLLM's."""
        counter = Counter(PREFIX + name, doc, [*LABELS, *extra], registry=self.registry)
        for engine in self.engines:
            for value in values or [None]:
                counter.labels(self.model_name, engine, *([value] if value is not None else []))
        return counter

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        histogram = Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry)
        for engine in self.engines:
            histogram.labels(self.model_name, engine)
        return histogram

    def _cache_config_info(self, info: dict[str, str]) -> None:
        gauge = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration (in the labels).",
                      [*LABELS, *info], registry=self.registry)
        for engine in self.engines:
            gauge.labels(self.model_name, engine, *info.values()).set(1)

    def instrument(self, app: Starlette) -> None:
        """Counts `app`'s HTTP requests into these metrics (call before it serves: it adds a middleware)."""
        app.add_middleware(HttpMetrics, families=HttpFamilies(self.registry))

    def render(self, stats: list[SchedulerStats]) -> bytes:
        """The exposition text, scheduler figures from `stats`: each engine core's, by data-parallel rank."""
        self.stats = stats
        return generate_latest(self.registry)

    async def observe(self, stream: AsyncIterator[RequestOutput],
                      params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Passes `stream` through, recording token counts and latencies; closing it closes `stream`. `params`:
        the request's (for request_params_max_tokens)."""
        seen, last, finished, engine = 0, None, False, "0"
        try:
            async with aclosing(stream):
                async for out in stream:
                    now = time.monotonic()
                    if out.metrics is not None:
                        engine = str(out.metrics.engine_index)
                    tokens = sum(len(c.token_ids) for c in out.outputs)
                    if tokens > seen:
                        self.generation_tokens.labels(self.model_name, engine).inc(tokens - seen)
                        self.total_generation_tokens += tokens - seen
                        if last is None and out.metrics is not None:
                            self.ttft.labels(self.model_name, engine).observe(
                                (out.metrics.first_token_time or now) - out.metrics.arrival_time)
                        elif last is not None:
                            gap, itl = (now - last) / (tokens - seen), self.itl.labels(self.model_name, engine)
                            for _ in range(tokens - seen):
                                itl.observe(gap)
                        seen, last = tokens, now
                    if out.finished:
                        finished = True
                        self._finished(out, now, engine, params)
                    yield out
        finally:
            if not finished:  # the client went away, or the engine died: vLLM counts it as an abort
                self.request_success.labels(self.model_name, engine, "abort").inc()

    def _finished(self, out: RequestOutput, now: float, engine: str, params: SamplingParams | None) -> None:
        if self.log_requests:
            _log_finished(out, now)
        self._count_prompt(len(out.prompt_token_ids), out.num_cached_tokens, engine, out.num_external_tokens)
        generated = [len(c.token_ids) for c in out.outputs]
        for histogram, value in ((self.request_generation_tokens, sum(generated)),
                                 (self.request_max_num_generation_tokens, max(generated, default=0)),
                                 (self.request_params_n, len(out.outputs))):
            histogram.labels(self.model_name, engine).observe(value)
        if params is not None and params.max_tokens:
            self.request_params_max_tokens.labels(self.model_name, engine).observe(params.max_tokens)
        self.request_num_preemptions.labels(self.model_name, engine).observe(
            out.metrics.num_preemptions if out.metrics is not None else 0)
        if out.metrics is not None:
            self._observe_times(out.metrics, now, max(generated, default=0), engine)
        # One count per request (vLLM's), with its first choice's reason.
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
        self.request_success.labels(self.model_name, engine, reason).inc()

    def _count_prompt(self, prompt: int, cached: int, engine: str, external: int = 0) -> None:
        """`cached`: prompt tokens not computed here, `external` of them loaded by a KV connector from another
        engine."""
        self.total_prompt_tokens += prompt
        self.prompt_tokens.labels(self.model_name, engine).inc(prompt)
        self.prompt_tokens_cached.labels(self.model_name, engine).inc(cached)
        if self.prompt_tokens_by_source is not None:
            self.prompt_tokens_by_source.labels(self.model_name, engine, "local_compute").inc(prompt - cached)
            self.prompt_tokens_by_source.labels(self.model_name, engine, "local_cache_hit").inc(cached - external)
            self.prompt_tokens_by_source.labels(self.model_name, engine, "external_kv_transfer").inc(external)
        if self.prompt_tokens_cached_by_source is not None:  # without tiers: the device's, or another engine's
            self.prompt_tokens_cached_by_source.labels(self.model_name, engine, "device").inc(cached - external)
            self.prompt_tokens_cached_by_source.labels(self.model_name, engine, "p2p").inc(external)
        self.request_prompt_tokens.labels(self.model_name, engine).observe(prompt)
        self.request_prefill_kv_computed_tokens.labels(self.model_name, engine).observe(prompt - cached)

    def _observe_times(self, m: RequestMetrics, now: float, longest: int, engine: str) -> None:
        """vLLM's intervals of a finished request, as far as it got (scheduled; given a first token)."""
        self.e2e.labels(self.model_name, engine).observe((m.finished_time or now) - m.arrival_time)
        if m.first_scheduled_time is None:
            return
        self.queue_time.labels(self.model_name, engine).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None or m.last_token_time is None:
            return
        decode = m.last_token_time - m.first_token_time
        for histogram, value in ((self.prefill_time, m.first_token_time - m.first_scheduled_time),
                                 (self.decode_time, decode),
                                 (self.inference_time, m.last_token_time - m.first_scheduled_time)):
            histogram.labels(self.model_name, engine).observe(value)
        if longest > 1:
            self.tpot.labels(self.model_name, engine).observe(decode / (longest - 1))

    async def log_periodically(self, read_stats, interval: float) -> None:
        """vLLM's periodic line: batch, KV usage, throughput and prefix-cache hit rate since the last one."""
        prev_prompt, prev_gen, prev_q, prev_h = 0.0, 0.0, 0, 0
        while True:
            await asyncio.sleep(interval)
            try:
                stats = await read_stats()
            except Exception:  # noqa: BLE001 — the engine is gone; nothing left to report
                return
            prompt, gen = self.total_prompt_tokens, self.total_generation_tokens
            queries, hits = stats.prefix_cache_queries - prev_q, stats.prefix_cache_hits - prev_h
            if prompt == prev_prompt and gen == prev_gen and not stats.num_running and not stats.num_waiting:
                continue  # idle: stay quiet
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        (prompt - prev_prompt) / interval, (gen - prev_gen) / interval, stats.num_running,
                        stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hits / queries if queries else 0.0)
            prev_prompt, prev_gen = prompt, gen
            prev_q, prev_h = stats.prefix_cache_queries, stats.prefix_cache_hits


def _log_finished(out: RequestOutput, now: float) -> None:
    generated = sum(len(c.token_ids) for c in out.outputs)
    m = out.metrics
    e2e = ((m.finished_time or now) - m.arrival_time) if m is not None else 0.0
    queued = (m.first_scheduled_time - m.arrival_time) if m is not None and m.first_scheduled_time else 0.0
    ttft = (m.first_token_time - m.arrival_time) if m is not None and m.first_token_time else 0.0
    logger.info("Finished request %s (session %s): %d prompt tokens, %d generated, finish %s, "
                "queued %.3fs, TTFT %.3fs, e2e %.3fs", printable(out.request_id), printable(out.session_id or "-"),
                len(out.prompt_token_ids), generated, ",".join(c.finish_reason or "abort" for c in out.outputs),
                queued, ttft, e2e)


class _SchedulerCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """Scheduler figures per engine core (vLLM's `engine` label: the data-parallel rank)."""
        m = self.metrics
        for kind, name, doc, attr in _ENGINE_FAMILIES:
            family = kind(PREFIX + name, doc, labels=LABELS)
            for index, s in enumerate(m.stats):
                family.add_metric([m.model_name, str(index)], getattr(s, attr) if attr is not None else 0)
            yield family
        yield _waiting_by_reason(m.model_name, m.stats)
        yield _sleep_state(m.model_name, m.stats)
        yield _iteration_tokens(m.model_name, m.stats)
        # with speculative decoding on: as configured, or (a shape not told) as some core's drafts show
        if m.shape.num_speculative_tokens or any(s.spec is not None and s.spec.num_drafts for s in m.stats):
            yield from _spec_families(m.model_name, m.shape.num_speculative_tokens, m.stats)
        offloads = [(str(i), e.offload) for i, e in enumerate(m.stats) if e.offload is not None]
        if offloads:
            yield from _offload_families(m.model_name, offloads)
        transfers = [(str(i), e.kv_transfer) for i, e in enumerate(m.stats) if e.kv_transfer is not None]
        if transfers:
            yield from _kv_transfer_families(m.model_name, transfers)
        if m.shape.max_loras:
            yield _lora_family(m.model_name, m.shape.max_loras, m.stats)


_ENGINE_FAMILIES = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage"),
    (CounterMetricFamily, "num_preemptions", "Preemptions since start.", "num_preemptions"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    (CounterMetricFamily, "external_prefix_cache_queries", "Prompt tokens of requests a KV connector was asked "
     "about (their first scheduling).", "external_prefix_cache_queries"),
    (CounterMetricFamily, "external_prefix_cache_hits", "Prompt tokens a KV connector loaded from another engine.",
     "external_prefix_cache_hits"),
    (CounterMetricFamily, "mm_cache_queries", "Multi-modal processor cache lookups (pressroom has no such cache).",
     None),
    (CounterMetricFamily, "mm_cache_hits", "Multi-modal processor cache hits (pressroom has no such cache).", None),
    (CounterMetricFamily, "estimated_flops_per_gpu", "Estimated floating point operations per GPU (for Model Flops "
     "Utilization; counted with --enable-mfu-metrics, else 0).", "estimated_flops"),
    (CounterMetricFamily, "estimated_read_bytes_per_gpu", "Estimated bytes read from memory per GPU (for Model "
     "Flops Utilization; counted with --enable-mfu-metrics, else 0).", "estimated_read_bytes"),
    (CounterMetricFamily, "estimated_write_bytes_per_gpu", "Estimated bytes written to memory per GPU (for Model "
     "Flops Utilization; counted with --enable-mfu-metrics, else 0).", "estimated_write_bytes"),
)


def _waiting_by_reason(model_name: str, stats: list[SchedulerStats]) -> Metric:
    """Each core's waiting requests, split as vLLM's: held back by room (capacity) or by something passing
    (deferred); the two add up to num_requests_waiting."""
    family = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason", "Waiting requests by why they wait: "
                               "capacity, or deferred (a sibling's prompt, a grammar compiling, LoRA slots, KV on "
                               "its way).", labels=[*LABELS, "reason"])
    for index, s in enumerate(stats):
        family.add_metric([model_name, str(index), "capacity"], s.num_waiting - s.num_waiting_deferred)
        family.add_metric([model_name, str(index), "deferred"], s.num_waiting_deferred)
    return family


def _sleep_state(model_name: str, stats: list[SchedulerStats]) -> Metric:
    """vLLM's engine_sleep_state per core: awake 1 while it is, else 0 with weights_offloaded 1 at sleep level 1
    or discard_all 1 at level 2 (a level-0 pause: all three 0)."""
    family = GaugeMetricFamily(PREFIX + "engine_sleep_state", "Engine sleep state: awake, or asleep at level 1 "
                               "(weights_offloaded) or 2 (discard_all).", labels=[*LABELS, "sleep_state"])
    for index, s in enumerate(stats):
        for level, state in enumerate(SLEEP_STATES):
            on = not s.sleeping if level == 0 else s.sleeping and s.sleep_level == level
            family.add_metric([model_name, str(index), state], float(on))
    return family


def _iteration_tokens(model_name: str, stats: list[SchedulerStats]) -> Metric:
    """Tokens scheduled per engine step, from each core's step counts per vLLM's bucket."""
    family = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens per engine step.", labels=LABELS)
    for index, s in enumerate(stats):
        family.add_metric([model_name, str(index)], _cumulative(ITERATION_TOKENS_BUCKETS, s.iteration_tokens),
                          s.iteration_tokens_sum)
    return family


def _cumulative(bounds, counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as Prometheus's cumulative (le, count) pairs, +Inf last."""
    pairs, running = [], 0
    for bound, count in zip((*(str(float(b)) for b in bounds), "+Inf"), counts):
        running += count
        pairs.append((bound, running))
    return pairs

_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Request-steps that verified drafts.", "num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)


def _spec_families(model_name: str, positions: int, stats: list[SchedulerStats]) -> Iterator[Metric]:
    """Speculative decoding's counters per engine core; accepted tokens also by draft position, from 0 up to
    num_speculative_tokens - 1 (and any further position an engine reported)."""
    for name, doc, attr in _SPEC_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        for index, s in enumerate(stats):
            family.add_metric([model_name, str(index)], getattr(s.spec, attr) if s.spec is not None else 0)
        yield family
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by draft position.", labels=[*LABELS, "position"])
    for index, s in enumerate(stats):
        accepted = s.spec.accepted_per_pos if s.spec is not None else []
        for pos in range(max(positions, len(accepted))):
            family.add_metric([model_name, str(index), str(pos)], accepted[pos] if pos < len(accepted) else 0)
    yield family


def _lora_family(model_name: str, max_loras: int, stats: list[SchedulerStats]) -> Metric:
    """vLLM's lora_requests_info: per engine core, the adapters of its running and waiting requests as labels
    (names comma-separated), its value the time of the snapshot."""
    family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                               labels=[*LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    for index, s in enumerate(stats):
        family.add_metric([model_name, str(index), str(max_loras), ",".join(s.waiting_loras),
                           ",".join(s.running_loras)], time.time())
    return family


_TIER_COUNTERS = (
    ("kv_offload_tiering_chunk_queries", "KV chunks looked up in the tier.", "chunk_queries"),
    ("kv_offload_tiering_chunk_hits", "KV chunks found in the tier and served.", "chunk_hits"),
    ("kv_offload_tiering_read_bytes", "Bytes read from the tier.", "read_bytes"),
    ("kv_offload_tiering_write_bytes", "Bytes written to the tier.", "write_bytes"),
    ("kv_offload_tiering_corrupt_chunks", "Chunks read but not served (truncated, corrupt, another model's).",
     "corrupt_chunks"),
    ("kv_offload_tiering_failed_jobs", "Stores and loads that did not complete.", "failed_jobs"),
)


def _offload_families(model_name: str, offloads: list[tuple[str, OffloadStats]]):
    """vLLM 0.28's KV offload metrics, per engine core (each has its own tiers): per tier ("index:kind")
    counters and transfer-time histograms, and the bytes moved between the device and the CPU tier by
    transfer type."""
    for name, doc, attr in _TIER_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "engine", "tier"])
        for engine, offload in offloads:
            for tier, stats in offload.tiers.items():
                family.add_metric([model_name, engine, tier], getattr(stats, attr))
        yield family
    for direction in ("read", "write"):
        family = HistogramMetricFamily(PREFIX + f"kv_offload_tiering_{direction}_time_seconds",
                                       f"Seconds one chunk's {direction} took in the tier.",
                                       labels=["model_name", "engine", "tier"])
        for engine, offload in offloads:
            for tier, stats in offload.tiers.items():
                hist = getattr(stats, f"{direction}_time")
                family.add_metric([model_name, engine, tier], _cumulative(TIME_BUCKETS, hist.buckets), hist.total)
        yield family
    family = CounterMetricFamily(PREFIX + "kv_offload_total_bytes", "Bytes moved between the device's KV cache "
                                 "and the CPU tier.", labels=["model_name", "engine", "transfer_type"])
    for engine, offload in offloads:
        for kind, nbytes in offload.total_bytes.items():
            family.add_metric([model_name, engine, kind], nbytes)
    yield family


_KV_TRANSFER_FAMILIES = (  # a KV connector's counters (disaggregated serving), per engine core
    ("kv_transfer_received_bytes", "KV chunk bytes read from other engines and checked.", "bytes_received"),
    ("kv_transfer_received_tokens", "Prompt tokens whose KV came from another engine.", "tokens_received"),
    ("kv_transfer_reads", "Reads of other engines' KV that completed and passed their checks.", "transfers_done"),
    ("kv_transfer_failed_reads", "Reads that failed, timed out or were corrupt (their prompts computed here).",
     "transfers_failed"),
    ("kv_transfer_corrupt_chunks", "Chunks read whose header or checksum did not hold.", "corrupt_chunks"),
    ("kv_transfer_staged_bytes", "KV chunk bytes staged for other engines.", "bytes_staged"),
    ("kv_transfer_sent_bytes", "Staged KV chunk bytes another engine confirmed it read.", "bytes_sent"),
    ("kv_transfer_expired", "Staged requests no engine read in time.", "transfers_expired"),
    ("kv_transfer_media_staged", "Media items whose encoder outputs were staged for other engines (E/P/D).",
     "media_staged"),
    ("kv_transfer_media_received", "Media items whose encoder outputs were read from another engine and used.",
     "media_received"),
    ("kv_transfer_media_failed_reads", "Encoder-output reads that failed or were corrupt (encoded here instead).",
     "media_failed"),
    ("mm_encoder_runs", "Media items this engine's encoder computed (E/P/D: none for those received).",
     "encoder_runs"),
)


def _kv_transfer_families(model_name: str, transfers: list):
    for name, doc, attr in _KV_TRANSFER_FAMILIES:
        family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        for engine, stats in transfers:
            family.add_metric([model_name, engine], getattr(stats, attr))
        yield family
    family = GaugeMetricFamily(PREFIX + "kv_transfer_staging_chunks_used", "Chunks of the KV staging buffer held.",
                               labels=LABELS)
    for engine, stats in transfers:
        family.add_metric([model_name, engine], stats.staging_slots_used)
    yield family


# prometheus_fastapi_instrumentator's defaults, as vLLM installs it (its excluded handlers)
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30,
                      60)
HTTP_LOWR_BUCKETS = (0.1, 0.5, 1)
HTTP_EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})


class HttpFamilies:
    """The HTTP families: by route template ("none" for a path no route matches), method and status class."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests_total", "HTTP requests by handler, method and status class.",
                                ["handler", "method", "status"], registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Request bodies' Content-Length.", ["handler"],
                                    registry=registry)
        self.response_size = Summary("http_response_size_bytes", "Response body bytes sent.", ["handler"],
                                     registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Request to whole response, "
                                        "every handler.", buckets=HTTP_HIGHR_BUCKETS, registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Request to whole response.",
                                  ["handler", "method"], buckets=HTTP_LOWR_BUCKETS, registry=registry)

    def observe(self, handler: str, method: str, status: int, request_bytes: int, response_bytes: int,
                seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.request_size.labels(handler).observe(request_bytes)
        self.response_size.labels(handler).observe(response_bytes)
        self.duration_highr.observe(seconds)
        self.duration.labels(handler, method).observe(seconds)


class HttpMetrics:
    """ASGI middleware that observes each HTTP request into `families` once its response is sent (or it fails:
    a 500 unless a status was sent)."""

    def __init__(self, app: ASGIApp, families: HttpFamilies) -> None:
        self.app, self.families = app, families

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = _route_template(scope) if scope["type"] == "http" else None
        if handler is None or handler in HTTP_EXCLUDED:
            await self.app(scope, receive, send)
            return
        started, status, sent = time.perf_counter(), 500, 0

        async def counting_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            length = dict(scope["headers"]).get(b"content-length", b"0")
            self.families.observe(handler, scope["method"], status, int(length) if length.isdigit() else 0, sent,
                                  time.perf_counter() - started)


def _route_template(scope: Scope) -> str:
    """The path template of the route that takes the request ("/v1/models"), or "none" (bounded labels)."""
    for route in getattr(scope.get("app"), "routes", ()):
        if route.matches(scope)[0] is Match.FULL:
            return route.path
    return "none"
