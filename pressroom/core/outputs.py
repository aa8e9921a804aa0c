"""The plain messages that cross the scheduler / model-runner boundary."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pressroom.lora.request import LoRARequest
from pressroom.multimodal.inputs import MediaItem
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner has not seen (or has forgotten, after preemption)."""
    req_id: str
    token_ids: list[int]  # prompt, then any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooling: PoolingParams | None = None  # a pooling request: its prompt's vector, no sampling
    # structured outputs: the runner masks its logits by it (xgrammar's JSON of it for worker processes)
    grammar: CompiledGrammar | str | None = None
    state_slot: int = -1  # recurrent layers: the request's live state slot (-1: a model without them)
    restore_slot: int = -1  # the prefix checkpoint its state starts from (-1: zeros)
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    mm_features: list[MediaItem] | None = None  # its images: the encoder's rows replace their placeholders


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


PLACEHOLDER_DRAFT = -1  # a scheduled draft whose id is still on the device (async scheduling)


@dataclass(slots=True)
class KVTransfers:
    """One step's KV offload copies, made before its forward pass in this order: device blocks out to
    CPU-tier slots reserved for them, then slots lent to the step into fresh device blocks; both as
    (block id, slot). Every rank copies its own KV heads. The slots are on loan until the step's output
    comes back (`step` names the loan in the offload store)."""
    step: int
    stores: list[tuple[int, int]]
    loads: list[tuple[int, int]]


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner-side state is stale: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # Draft tokens to verify, per request; they are the last len(drafts) of its scheduled tokens
    # (PLACEHOLDER_DRAFT each under async drafting: the runner holds their ids on the device).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # How many drafts each request that samples this step should have drafted for its next one (the
    # adaptive budget's plan, where drafting has a cost of its own: a draft model); absent: all K.
    draft_limits: dict[str, int] = field(default_factory=dict)
    # KV offload copies the runner makes before the forward pass (None: none this step).
    kv_transfers: KVTransfers | None = None
    # Recurrent layers' prefix checkpoints: per request, (tokens of its step after which its state is copied,
    # checkpoint slot), in order.
    state_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Top-N logprobs of one position: (token ids, logprobs), the chosen token first, then by rank.
TopLogprobs = tuple[list[int], list[float], list[int]]  # ids, logprobs, ranks


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]  # empty list for a prefill chunk that did not reach the end
    logprobs: dict[str, list[TopLogprobs]] = field(default_factory=dict)
    # Per request, logprobs of prompt positions computed this step (None for position 0).
    prompt_logprobs: dict[str, list[TopLogprobs | None]] = field(default_factory=dict)
    # Per request, drafts proposed for its next step (speculative decoding), and the drafter's
    # per-token confidence where it gives one.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_confidences: dict[str, list[float]] = field(default_factory=dict)
    # Per pooling request whose prompt this step finished, its vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)


class AsyncModelRunnerOutput(ABC):
    """A launched step's output that is not on the host yet (async scheduling): the engine schedules the
    next step before it asks for this one."""

    @abstractmethod
    def resolve(self) -> ModelRunnerOutput:
        """Waits for the step's results and returns them (again, on later calls)."""


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's vector (it finishes with it)
    # a KV connector's producer: where a decode engine finds this finished request's prompt KV (vLLM's field)
    kv_transfer_params: dict | None = None
    num_external_tokens: int = 0  # of num_cached_tokens, the ones a KV connector loaded from another engine
    num_preemptions: int = 0  # times the scheduler preempted it so far (vLLM's request_num_preemptions)
