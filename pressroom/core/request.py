"""One sequence the scheduler tracks: prompt, generated tokens, progress and status."""
from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pressroom.lora.request import LoRARequest
from pressroom.multimodal.inputs import MediaItem
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine failed while running it

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # A sibling (n > 1) whose prompt must be computed first, so this one finds it in the prefix cache.
    follows: Request | None = None
    # The client's request this one was fanned out of (its n samples, a prompt list's prompts): the scheduler
    # shares slots fairly between groups. Default: the sibling it follows, else its own.
    group: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled, not when it finishes
    # Tokens that scheduled steps whose results have not come back yet may emit (1 + drafts each; async
    # scheduling keeps one step in flight); the next step's input is such a token, read from the device.
    num_output_placeholders: int = 0
    # Drafts for the next step (speculative decoding); under async drafting, placeholders (-1) whose
    # ids the runner holds on the device.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_confidences: list[float] = field(default_factory=list)  # the drafter's, per draft token, if any
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling; -1 until then
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # A pooling request: prefill only, it finishes with its prompt's vector. `whole_prompt`: an encoder's
    # (bidirectional attention), computed in one step or not at all.
    pooling: PoolingParams | None = None
    whole_prompt: bool = False
    # Structured outputs: its grammar's compile (core/structured_outputs.py); it waits in the queue until done.
    grammar: Future[CompiledGrammar] | None = None
    lora: LoRARequest | None = None  # the adapter it runs with: its KV is its own (prefix-cache keys)
    cache_salt: str | None = None  # vLLM's: requests with different salts never share prefix-cache blocks
    mm_features: list[MediaItem] | None = None  # its images (placeholder runs in the prompt; prefix-cache keys)

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.follows.group if self.follows is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def is_ready(self) -> bool:
        """False while the sibling whose prompt this one shares is still prefilling."""
        lead = self.follows
        return lead is None or lead.status.finished or lead.num_computed_tokens >= lead.num_prompt_tokens

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
