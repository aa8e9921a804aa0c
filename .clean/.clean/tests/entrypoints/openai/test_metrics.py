"""ServerMetrics on output streams: request_success_total counts requests (not choices), labelled with vLLM's
finished_reason; a request that ends without a final output (its client left, the engine ended it) counts as
"abort", one whose output handling failed as "error"."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.metrics import ServerMetrics
from pressroom.outputs import CompletionOutput, RequestMetrics, RequestOutput


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
    value = metrics.registry.get_sample_value("pressroom:request_success_total",
                                              {"model_name": "m", "finished_reason": reason})
    return value or 0.0


async def _drain(stream) -> None:
    async with aclosing(stream):
        async for _ in stream:
            pass


def test_request_success_counts_requests_not_choices():
    metrics = ServerMetrics("pressroom:", "m", log_requests=False)
    n3 = [_out([None, None, None], 1), _out(["length", "stop", "length"], 4)]  # one request, n=3
    asyncio.run(_drain(metrics.observe(_stream(n3))))
    assert _success(metrics, "length") == 1 and _success(metrics, "stop") == 0  # its first choice's reason
    assert metrics.registry.get_sample_value("pressroom:generation_tokens_total", {"model_name": "m"}) == 12
    assert metrics.registry.get_sample_value("pressroom:prompt_tokens_total", {"model_name": "m"}) == 3


def test_abandoned_and_ended_requests_count_as_abort_and_failed_ones_as_error():
    metrics = ServerMetrics("pressroom:", "m", log_requests=False)

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
                if s.name == "pressroom:request_success_total")
    assert total == 4  # one count per request, whatever happened to it
