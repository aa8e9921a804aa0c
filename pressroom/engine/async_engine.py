"""The asynchronous engine the server runs: the front-end here, the engine core in its own process.

The front-end (an LLMEngine over a CoreClient: tokenization, validation, detokenization, stop strings,
output assembly) lives in the API process. One output thread receives the core's step outputs, turns
them into RequestOutputs and hands each to its caller's event loop with `call_soon_threadsafe`; the
same lock serialises it with adds and aborts. An event loop never waits for that lock (held while a step's
outputs are made: tens of milliseconds for n=128 with logprobs): adds run on a thread of their own, as does an
abort that finds the lock taken. A consumer that stops iterating (a client that disconnects, a cancelled task)
aborts its request, which frees its KV blocks in the core.

When the core dies or fails, every stream ends with EngineDeadError at once and later requests are
refused with it; `is_running` turns false. A fault confined to one request's outputs (its detokenization,
stop strings, output assembly) ends that request alone, with finish_reason "error" (LLMEngine.process_outputs).

The core sends a message after every step and a heartbeat once a second when idle; `unhealthy_reason` says
the engine is stalled when none has come for longer than the caller's threshold. `abort_all` ends every
request in flight with an error (the server's graceful shutdown, when its grace period is over).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pressroom.config import EngineArgs, EngineConfig
from pressroom.core.scheduler import SchedulerStats, SpecDecodingStats
from pressroom.core.spec_calibration import ReliabilityTable
from pressroom.engine.core import check_sleep_args, check_sleep_enabled
from pressroom.engine.core_client import CoreClient, EngineDeadError
from pressroom.engine.dp_client import DPCoreClient
from pressroom.engine.llm_engine import LLMEngine, PromptType, start_config
from pressroom.lora.request import LoRARequest
from pressroom.outputs import PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

logger = logging.getLogger("pressroom")

_ABORTED = object()  # the request was aborted by someone other than its consumer


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        make_core = DPCoreClient if config.parallel.data_parallel_size > 1 else CoreClient
        self.engine = LLMEngine(config, make_core=make_core)  # a start-up error is raised here, in the caller
        self._client: CoreClient | DPCoreClient = self.engine.core
        self._lock = threading.Lock()
        # adds (and aborts that find the lock taken), in order, off the event loops: they wait for the lock, and a
        # big request's messages to the core (n samples of its prompt) take milliseconds to encode
        self._adder = ThreadPoolExecutor(1, thread_name_prefix="pressroom-add")
        self._streams: dict[str, _Stream] = {}
        self._stats = [SchedulerStats() for _ in range(config.parallel.data_parallel_size)]  # per engine core
        self._error: BaseException | None = None
        self._closed = False
        self._refusal: str | None = None  # set by abort_all: why new requests are refused
        self._last_heard = time.monotonic()  # when the core last sent anything (outputs or a heartbeat)
        # sleep mode: per engine core, the callers waiting for its answers to sleep / wake_up, in the order sent
        self._replies: list[deque[Future]] = [deque() for _ in self._stats]
        self._thread = threading.Thread(target=self._output_loop, name="pressroom-output", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(start_config(args))

    # ---- what the front-end knows ----

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def startup_seconds(self) -> float:
        return self.engine.startup_seconds

    @property
    def cuda_graphs(self) -> bool:
        return self._client.info.cuda_graphs

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._closed

    @property
    def seconds_since_heard(self) -> float:
        """Seconds since the core last sent anything: step outputs, or its once-a-second idle heartbeat."""
        return time.monotonic() - self._last_heard

    def unhealthy_reason(self, stall_timeout: float | None = None) -> str | None:
        """None while the engine can serve; else why not: its core failed or was shut down, or (with
        `stall_timeout`) nothing has been heard from it for longer than that many seconds, so its loop is
        stuck (one step can take seconds, so the threshold must be longer than the longest step)."""
        if self._error is not None:
            return str(self._error)
        if self._closed or not self._thread.is_alive():
            return "The engine is shut down."
        if self._refusal is not None:
            return self._refusal
        silent = self.seconds_since_heard
        if stall_timeout is not None and stall_timeout > 0 and silent > stall_timeout:
            return (f"The engine loop has made no progress for {silent:.1f} s (the engine core sends outputs after "
                    f"every step and a heartbeat every second; the stall threshold is {stall_timeout:g} s).")
        return None

    # ---- requests ----

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                       priority: int = 0, session_id: str | None = None, data_parallel_rank: int | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; ValueError if the engine rejects it (nothing else changes)."""
        outputs = await self.add_request(request_id, prompt, params, priority, session_id,
                                         data_parallel_rank=data_parallel_rank)
        async for out in outputs:
            yield out

    async def encode(self, request_id: str, prompt: PromptType, pooling: PoolingParams | None = None,
                     priority: int = 0, group: str | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's stream (one final PoolingRequestOutput); ValueError if the engine rejects it.
        `group`: the API request it is one input of (admitted fairly against other requests)."""
        return await self.add_request(request_id, prompt, None, priority, pooling=pooling, group=group)

    @property
    def runner(self) -> str:
        """generate or pooling (config.ModelConfig.runner)."""
        return self.engine.config.model.runner

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          priority: int = 0, session_id: str | None = None,
                          pooling: PoolingParams | None = None, data_parallel_rank: int | None = None,
                          group: str | None = None, lora_request: LoRARequest | None = None,
                          mm_features: list | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request (ValueError if rejected) and returns its output stream, which the caller must
        iterate or close: leaving the stream before the request finishes aborts it. `mm_features`: the prompt's
        media processed beforehand (LLMEngine.process_media, off the engine's lock)."""
        self._check_alive()
        if self._refusal is not None:
            raise EngineDeadError(self._refusal)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        add = functools.partial(self._add, request_id, prompt, params, priority, session_id, pooling,
                                data_parallel_rank, stream, group, lora_request, mm_features)
        added = stream.loop.run_in_executor(self._adder, add)
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:  # the caller left; the add goes on, so its request is aborted once added
            added.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.abort(request_id))
            raise
        return self._iterate(request_id, stream)

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams | None, priority: int,
             session_id: str | None, pooling: PoolingParams | None, data_parallel_rank: int | None,
             stream: _Stream, group: str | None = None, lora_request: LoRARequest | None = None,
             mm_features: list | None = None) -> None:
        with self._lock:
            if pooling is not None:
                self.engine.add_pooling_request(request_id, prompt, pooling, priority=priority)
            else:
                self.engine.add_request(request_id, prompt, params, priority=priority, session_id=session_id,
                                        data_parallel_rank=data_parallel_rank, group=group,
                                        lora_request=lora_request, mm_features=mm_features)
            self._streams[request_id] = stream  # (add_request undoes itself if it raises: nothing to clean)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty():  # outputs are cumulative: the newest one says it all
                    if not isinstance(item, RequestOutput) or item.finished:
                        break
                    item = stream.queue.get_nowait()
                if item is _ABORTED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; a consumer still iterating sees its stream end. Done at once if the lock is
        free, else on the adder's thread (a caller on an event loop never waits for it)."""
        if self._closed or self._error is not None:
            return
        if not self._lock.acquire(blocking=False):
            with contextlib.suppress(RuntimeError):  # shut down meanwhile: every request is ended anyway
                self._adder.submit(self._abort, request_id)
            return
        try:
            stream = self._abort_locked(request_id)
        finally:
            self._lock.release()
        self._end_aborted(stream)

    def _abort(self, request_id: str) -> None:
        if self._closed or self._error is not None:
            return
        with self._lock:
            stream = self._abort_locked(request_id)
        self._end_aborted(stream)

    def _abort_locked(self, request_id: str) -> _Stream | None:
        self.engine.abort_request(request_id)
        return self._streams.pop(request_id, None)

    @staticmethod
    def _end_aborted(stream: _Stream | None) -> None:
        if stream is not None:
            _call_soon(stream.loop, stream.queue.put_nowait, _ABORTED)

    def abort_all(self, message: str) -> int:
        """Ends every request in flight: the core drops them, and each stream raises EngineDeadError(message)
        (the server's handlers turn it into a 503, or an SSE error event after a finish_reason "abort"
        chunk). Later requests are refused with the same error. Thread-safe; returns how many were ended."""
        if self._closed or self._error is not None:
            return 0
        with self._lock:
            self._refusal = message
            self.engine.abort_request(list(self.engine.parents))
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _call_soon(stream.loop, stream.queue.put_nowait, EngineDeadError(message))
        return len(streams)

    async def reset_prefix_cache(self) -> None:
        """Every engine core forgets its cached prefixes (vLLM's `reset_prefix_cache`): a request added after this
        returns finds none. Sent on the adder's thread, in order with the adds (the core's socket is not
        thread-safe)."""
        self._check_alive()
        await asyncio.get_running_loop().run_in_executor(self._adder, self._reset_prefix_cache)

    def _reset_prefix_cache(self) -> None:
        with self._lock:
            self._client.reset_prefix_cache()

    # ---- sleep mode ----

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep, on every engine core (EngineCore.sleep): returns once each has done it. "abort" ends the
        requests in flight (their streams finish with finish_reason "abort"); "wait" returns once they are done;
        requests added while asleep wait for wake_up. ValueError: sleep mode is off, or a bad level or mode."""
        check_sleep_args(self.engine.config.model.enable_sleep_mode, level, mode)
        await self._ask_cores(lambda: self._client.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up on every engine core (EngineCore.wake_up); returns once each has done it."""
        check_sleep_enabled(self.engine.config.model.enable_sleep_mode)
        await self._ask_cores(lambda: self._client.wake_up(tags))

    async def is_sleeping(self) -> bool:
        """Whether any engine core is asleep (at any level), as its latest message says."""
        return any(s.sleeping for s in self._stats)

    async def _ask_cores(self, send: Callable[[], None]) -> None:
        """Sends a sleep-mode call to every core (on the adder's thread, in order with the adds) and waits for
        each core's answer; a core's refusal is raised (a ValueError stays one)."""
        self._check_alive()
        answers = [Future() for _ in self._replies]

        def sent() -> None:
            with self._lock:
                for queue, answer in zip(self._replies, answers):
                    queue.append(answer)
                send()
        await asyncio.get_running_loop().run_in_executor(self._adder, sent)
        for reply in await asyncio.gather(*(asyncio.wrap_future(a) for a in answers)):
            if reply:
                kind, _, text = reply.partition(": ")
                raise ValueError(text) if kind == "ValueError" else RuntimeError(reply)

    async def stats(self) -> SchedulerStats:
        """The core's latest figures (it sends them with every step, and once a second when idle); with
        several engine cores, their sums (KV usage: their mean)."""
        return merge_stats(self._stats)

    async def engine_stats(self) -> list[SchedulerStats]:
        """Each engine core's latest figures, by data-parallel rank."""
        return list(self._stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core; requests still in flight end with EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self._thread.join(timeout)
        self._client.shutdown(timeout)
        self._fail_all(EngineDeadError("The engine is shut down."))
        self._adder.shutdown(wait=False)

    # ---- the output thread ----

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(str(self._error)) from self._error
        if self._closed:
            raise EngineDeadError("The engine is shut down.")

    def _output_loop(self) -> None:
        try:
            while not self._closed:
                step = self._client.recv()
                if step is None:
                    continue
                self._last_heard = time.monotonic()
                if step.stats is not None:
                    self._stats[step.engine_index] = step.stats
                with self._lock:  # a fault in one request's outputs ends that request alone (in process_outputs)
                    outputs = self.engine.process_outputs(step)
                    waiting = self._replies[step.engine_index]
                    answer = waiting.popleft() if step.reply is not None and waiting else None
                self._deliver(outputs)
                if answer is not None:  # after the requests it ended are delivered, and with its stats in place
                    answer.set_result(step.reply)
        except BaseException as e:  # noqa: BLE001 — every waiting caller must hear of it
            if not isinstance(e, EngineDeadError):
                logger.exception("the engine's output thread failed")
                e = EngineDeadError(f"The engine's output thread failed: {e!r}")
            logger.error("%s", e)
            self._error = e
            self._fail_all(e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            answers = [a for queue in self._replies for a in queue]
            for queue in self._replies:
                queue.clear()
        for answer in answers:
            answer.set_exception(error)
        for stream in streams:
            _call_soon(stream.loop, stream.queue.put_nowait, error)


def merge_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """Several cores' figures as one: counts summed, KV usage averaged. (KV offload's figures are each
    core's own tiers': reported per core, not merged.)"""
    if len(per_engine) == 1:
        return per_engine[0]
    specs = [s.spec for s in per_engine if s.spec is not None]
    spec = None
    if specs:
        positions = max(len(s.accepted_per_pos) for s in specs)
        spec = SpecDecodingStats(sum(s.num_drafts for s in specs), sum(s.num_draft_tokens for s in specs),
                                 sum(s.num_accepted_tokens for s in specs),
                                 [sum(s.accepted_per_pos[i] for s in specs if i < len(s.accepted_per_pos))
                                  for i in range(positions)],
                                 ReliabilityTable.merged([s.stated for s in specs]),
                                 ReliabilityTable.merged([s.calibrated for s in specs]))
    return SchedulerStats(sum(s.num_running for s in per_engine), sum(s.num_waiting for s in per_engine),
                          sum(s.kv_cache_usage for s in per_engine) / len(per_engine),
                          sum(s.num_preemptions for s in per_engine),
                          sum(s.prefix_cache_queries for s in per_engine), sum(s.prefix_cache_hits for s in per_engine),
                          spec, num_waiting_deferred=sum(s.num_waiting_deferred for s in per_engine),
                          iteration_tokens=[sum(counts) for counts in zip(*(s.iteration_tokens for s in per_engine))],
                          iteration_tokens_sum=sum(s.iteration_tokens_sum for s in per_engine),
                          external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in per_engine),
                          external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in per_engine))


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
