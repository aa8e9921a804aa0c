"""vLLM's `AsyncEngineArgs`: EngineArgs for AsyncLLMEngine.from_engine_args, as vLLM users build them."""
from __future__ import annotations

from dataclasses import dataclass

from pressroom.config import EngineArgs


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncEngineArgs(EngineArgs):
    # vLLM's AsyncLLM logs each added request when this is on. pressroom's AsyncLLMEngine has no such line (the
    # server logs requests): True is refused rather than ignored.
    enable_log_requests: bool = False

    def __post_init__(self) -> None:
        if self.enable_log_requests:
            raise ValueError("enable_log_requests is not supported by pressroom's AsyncLLMEngine (it logs no "
                             "requests); `pressroom serve --enable-log-requests` logs them at the server.")
