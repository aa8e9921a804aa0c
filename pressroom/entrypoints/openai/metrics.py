"""Prometheus metrics with vLLM's names under a configurable prefix (`pressroom:` or `vllm:`).

Per-request figures are observed on the output streams as they pass through the server; scheduler
gauges and counters are a snapshot read on the engine thread at scrape time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pressroom.core.scheduler import SchedulerStats
from pressroom.engine.async_engine import merge_stats
from pressroom.kv_offload.manager import TIME_BUCKETS, OffloadStats
from pressroom.logger import printable
from pressroom.outputs import RequestOutput

logger = logging.getLogger("pressroom")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `*_created` series (a creation timestamp beside every counter and histogram): they add a series per
# counter to every scrape with nothing a dashboard plots. prometheus_client's switch is process-wide.
disable_created_metrics()


class ServerMetrics:
    """`log_requests`: an INFO line per finished engine request (off with --disable-log-requests)."""

    def __init__(self, prefix: str, model_name: str, log_requests: bool = True) -> None:
        self.prefix, self.model_name, self.log_requests = prefix, model_name, log_requests
        self.registry = CollectorRegistry()
        self.stats: list[SchedulerStats] = [SchedulerStats()]  # per engine core (data-parallel rank)
        self.total_prompt_tokens = self.total_generation_tokens = 0  # for the log line
        # Only model_name (and finished_reason) label series. A request's session id goes to its log line,
        # never to a label: session ids are unbounded, and one time series per session would grow the
        # registry (and every scrape) without limit.
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.").labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.").labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.").labels(model_name)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.").labels(model_name)
        self.registry.register(_SchedulerCollector(self))

    def render(self, stats: list[SchedulerStats]) -> bytes:
        """The exposition text, scheduler figures from `stats`: each engine core's, by data-parallel rank."""
        self.stats = stats
        return generate_latest(self.registry)

    async def observe(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Passes `stream` through, recording token counts and latencies; closing it closes `stream`."""
        seen, last, finished = 0, None, False
        try:
            async with aclosing(stream):
                async for out in stream:
                    now = time.monotonic()
                    tokens = sum(len(c.token_ids) for c in out.outputs)
                    if tokens > seen:
                        self.generation_tokens.inc(tokens - seen)
                        self.total_generation_tokens += tokens - seen
                        if last is None and out.metrics is not None:
                            self.ttft.observe((out.metrics.first_token_time or now) - out.metrics.arrival_time)
                        elif last is not None:
                            gap = (now - last) / (tokens - seen)
                            for _ in range(tokens - seen):
                                self.itl.observe(gap)
                        seen, last = tokens, now
                    if out.finished:
                        finished = True
                        self._finished(out, now)
                    yield out
        finally:
            if not finished:  # the client went away, or the engine died: vLLM counts it as an abort
                self.request_success.labels(self.model_name, "abort").inc()

    def _finished(self, out: RequestOutput, now: float) -> None:
        if self.log_requests:
            _log_finished(out, now)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.total_prompt_tokens += len(out.prompt_token_ids)
        if out.metrics is not None:
            self.e2e.observe((out.metrics.finished_time or now) - out.metrics.arrival_time)
            if out.metrics.first_scheduled_time is not None:
                self.queue_time.observe(out.metrics.first_scheduled_time - out.metrics.arrival_time)
        # One count per request (vLLM's), with its first choice's reason.
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
        self.request_success.labels(self.model_name, reason).inc()

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

    def collect(self):
        """Scheduler figures per engine core (vLLM's `engine` label: the data-parallel rank)."""
        m = self.metrics
        for kind, name, doc, attr in _ENGINE_FAMILIES:
            family = kind(m.prefix + name, doc, labels=["model_name", "engine"])
            for index, s in enumerate(m.stats):
                family.add_metric([m.model_name, str(index)], getattr(s, attr))
            yield family
        yield from self._spec_and_offload(merge_stats(m.stats))

    def _spec_and_offload(self, s: SchedulerStats):
        m = self.metrics
        families = []
        spec = s.spec
        if spec is not None and spec.num_drafts:
            families += [
                (CounterMetricFamily, "spec_decode_num_drafts", "Request-steps that verified drafts.", spec.num_drafts),
                (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens verified.",
                 spec.num_draft_tokens),
                (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens),
            ]
        for kind, name, doc, value in families:
            family = kind(m.prefix + name, doc, labels=["model_name"])
            family.add_metric([m.model_name], value)
            yield family
        offloads = [(str(i), e.offload) for i, e in enumerate(m.stats) if e.offload is not None]
        if offloads:
            yield from _offload_families(m.prefix, m.model_name, offloads)
        if spec is not None and spec.num_drafts:
            family = CounterMetricFamily(m.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by draft position.", labels=["model_name", "position"])
            for pos, count in enumerate(spec.accepted_per_pos):
                family.add_metric([m.model_name, str(pos)], count)
            yield family


_ENGINE_FAMILIES = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage"),
    (CounterMetricFamily, "num_preemptions", "Preemptions since start.", "num_preemptions"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
)

_TIER_COUNTERS = (
    ("kv_offload_tiering_chunk_queries", "KV chunks looked up in the tier.", "chunk_queries"),
    ("kv_offload_tiering_chunk_hits", "KV chunks found in the tier and served.", "chunk_hits"),
    ("kv_offload_tiering_read_bytes", "Bytes read from the tier.", "read_bytes"),
    ("kv_offload_tiering_write_bytes", "Bytes written to the tier.", "write_bytes"),
    ("kv_offload_tiering_corrupt_chunks", "Chunks read but not served (truncated, corrupt, another model's).",
     "corrupt_chunks"),
    ("kv_offload_tiering_failed_jobs", "Stores and loads that did not complete.", "failed_jobs"),
)


def _offload_families(prefix: str, model_name: str, offloads: list[tuple[str, OffloadStats]]):
    """vLLM 0.28's KV offload metrics, per engine core (each has its own tiers): per tier ("index:kind")
    counters and transfer-time histograms, and the bytes moved between the device and the CPU tier by
    transfer type."""
    for name, doc, attr in _TIER_COUNTERS:
        family = CounterMetricFamily(prefix + name, doc, labels=["model_name", "engine", "tier"])
        for engine, offload in offloads:
            for tier, stats in offload.tiers.items():
                family.add_metric([model_name, engine, tier], getattr(stats, attr))
        yield family
    for direction in ("read", "write"):
        family = HistogramMetricFamily(prefix + f"kv_offload_tiering_{direction}_time_seconds",
                                       f"Seconds one chunk's {direction} took in the tier.",
                                       labels=["model_name", "engine", "tier"])
        for engine, offload in offloads:
            for tier, stats in offload.tiers.items():
                hist = getattr(stats, f"{direction}_time")
                cumulative, running = [], 0
                for bound, count in zip((*map(str, TIME_BUCKETS), "+Inf"), hist.buckets):
                    running += count
                    cumulative.append((bound, running))
                family.add_metric([model_name, engine, tier], cumulative, hist.total)
        yield family
    family = CounterMetricFamily(prefix + "kv_offload_total_bytes", "Bytes moved between the device's KV cache "
                                 "and the CPU tier.", labels=["model_name", "engine", "transfer_type"])
    for engine, offload in offloads:
        for kind, nbytes in offload.total_bytes.items():
            family.add_metric([model_name, engine, kind], nbytes)
    yield family
