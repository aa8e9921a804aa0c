"""What the engine hands back to callers (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob; the chosen token first, then the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (its output handling failed)
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """A request's times, all time.monotonic() (one clock for every process of a machine, so the engine core's
    scheduling time compares with the front-end's): arrival, its first scheduling by the engine core (its queue
    time ends), its first and last output tokens reaching the front-end, its end. `engine_index`: the
    data-parallel engine core that scheduled it. `num_preemptions`: the times the scheduler preempted it (its
    samples' together)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    engine_index: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    session_id: str | None = None  # the caller's session (e.g. the server's X-Session-Id), as given
    kv_transfer_params: dict | None = None  # a KV producer's: where a decode engine finds its prompt's KV (vLLM's)
    num_external_tokens: int = 0  # of num_cached_tokens, the ones a KV connector loaded from another engine


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's PoolingOutput; `embedding` is EmbeddingOutput's name for it)."""
    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
    finish_reason: str | None = "stop"  # "error" where the engine failed while computing it
