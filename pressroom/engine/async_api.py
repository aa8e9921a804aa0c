"""`pressroom.AsyncLLMEngine`: the async engine with vLLM's calling convention, for scripts written against
`vllm.AsyncLLMEngine` (`async for out in engine.generate(prompt, sampling_params, request_id)`).

pressroom's own engine (engine/async_engine.py, what the server drives) takes the request id first; this subclass
takes vLLM's order and keywords, and also pressroom's (the second argument tells them apart: vLLM's is a
SamplingParams, pressroom's a prompt). vLLM's `abort` and `get_tokenizer` are awaited; here they act at once and
their results may be awaited too.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from pressroom.config import EngineArgs
from pressroom.engine.async_engine import AsyncLLMEngine as _AsyncLLMEngine
from pressroom.engine.async_engine import EngineDeadError
from pressroom.engine.llm_engine import PromptType
from pressroom.lora.request import LoRARequest
from pressroom.outputs import PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams


class _Done:
    """An awaitable that is already done: what vLLM's coroutine methods return here, after doing their work."""
    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # noqa: B901 — a generator: awaiting it returns `value` at once


class AsyncLLMEngine(_AsyncLLMEngine):
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: list | None = None, **unsupported: Any) -> AsyncLLMEngine:
        """vLLM's signature: `usage_context` (a telemetry label) is taken and unused; what pressroom cannot honour
        (a loop started later, custom stat loggers, other arguments) is refused by name."""
        if not start_engine_loop:
            raise ValueError("start_engine_loop=False is not supported: pressroom's engine loop starts with it.")
        if stat_loggers:
            raise ValueError("stat_loggers is not supported: pressroom's metrics are the server's /metrics.")
        if unsupported:
            raise ValueError(f"AsyncLLMEngine.from_engine_args got unsupported argument(s): "
                             f"{', '.join(sorted(unsupported))}.")
        return super().from_engine_args(engine_args)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """vLLM's `generate(prompt, sampling_params, request_id, *, lora_request=None, priority=0,
        data_parallel_rank=None)`, or pressroom's `generate(request_id, prompt, params, priority, ...)`: the
        request's cumulative outputs, the last one finished."""
        if "sampling_params" in kwargs or (len(args) >= 2 and isinstance(args[1], SamplingParams)):
            request_id, prompt, params, options = _vllm_generate_args(*args, **kwargs)
            outputs = await self.add_request(request_id, prompt, params, **options)
        else:
            outputs = _AsyncLLMEngine.generate(self, *args, **kwargs)
        async for out in outputs:
            yield out

    async def encode(self, *args: Any, **kwargs: Any) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's `encode(prompt, pooling_params, request_id, *, priority=0)`, or pressroom's
        `encode(request_id, prompt, pooling, priority)`."""
        if "pooling_params" in kwargs or (len(args) >= 2 and isinstance(args[1], PoolingParams)):
            request_id, prompt, pooling, priority = _vllm_encode_args(*args, **kwargs)
            stream = await _AsyncLLMEngine.encode(self, request_id, prompt, pooling, priority)
        else:
            stream = await _AsyncLLMEngine.encode(self, *args, **kwargs)
        async for out in stream:
            yield out

    def abort(self, request_id: str | Iterable[str], internal: bool = False) -> _Done:
        """Ends the request(s) (vLLM's `await engine.abort(request_id)`; done before the await)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            _AsyncLLMEngine.abort(self, rid)
        return _Done()

    def get_tokenizer(self, lora_request: LoRARequest | None = None) -> _Done:
        """The tokenizer (vLLM's `await engine.get_tokenizer()`)."""
        return _Done(self.tokenizer)

    def check_health(self) -> _Done:
        """Raises EngineDeadError if the engine cannot serve (vLLM's `await engine.check_health()`)."""
        reason = self.unhealthy_reason()
        if reason is not None:
            raise EngineDeadError(reason)
        return _Done()

    @property
    def errored(self) -> bool:
        return self.unhealthy_reason() is not None and not self._closed

    @property
    def is_stopped(self) -> bool:
        return self._closed


def _vllm_generate_args(prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                        lora_request: LoRARequest | None = None, priority: int = 0,
                        data_parallel_rank: int | None = None, **unsupported: Any
                        ) -> tuple[str, PromptType, SamplingParams, dict]:
    _refuse(unsupported, "generate")
    return request_id, prompt, sampling_params, {"priority": priority, "data_parallel_rank": data_parallel_rank,
                                                 "lora_request": lora_request}


def _vllm_encode_args(prompt: PromptType, pooling_params: PoolingParams, request_id: str, *,
                      lora_request: LoRARequest | None = None, priority: int = 0, **unsupported: Any
                      ) -> tuple[str, PromptType, PoolingParams, int]:
    if lora_request is not None:
        raise ValueError("lora_request is not supported for pooling: adapters apply to generation only.")
    _refuse(unsupported, "encode")
    return request_id, prompt, pooling_params, priority


def _refuse(unsupported: dict[str, Any], method: str) -> None:
    given = sorted(name for name, value in unsupported.items() if value is not None)
    if given:
        raise ValueError(f"AsyncLLMEngine.{method} got unsupported argument(s): {', '.join(given)} (pressroom takes "
                         "lora_request, priority and data_parallel_rank).")
