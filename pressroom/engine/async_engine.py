"""The asynchronous engine: `LLMEngine` stepped by one dedicated thread, outputs streamed per request.

LLMEngine is not thread-safe, so the engine thread is the only one that touches it: callers hand it
commands (add, abort, any callable) through a queue and it runs them between steps. Outputs go back
to each caller's event loop with `call_soon_threadsafe`. A consumer that stops iterating (a client
that disconnects, a cancelled task) aborts its request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pressroom.config import EngineArgs
from pressroom.engine.llm_engine import LLMEngine, PromptType
from pressroom.outputs import RequestOutput
from pressroom.sampling_params import SamplingParams

logger = logging.getLogger("pressroom")

T = TypeVar("T")
_STOP = object()
_ABORTED = object()  # the request was aborted by someone other than its consumer


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """Takes an engine, or a function that builds one on the engine thread (see from_engine_args)."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._error: BaseException | None = None
        self._closed = False
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_loop, args=(engine, built), name="pressroom-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()  # a build error is raised here, in the caller

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Builds the engine on the engine thread, so that one thread runs all of its OpenMP work.

        Why: libgomp keeps a worker pool per thread that has run a parallel region, and once more
        workers exist than cores it stops spin-waiting between regions. A model loaded (and warmed)
        on the main thread but stepped on another made every step ~30% slower on 2 cores.
        """
        return cls(lambda: LLMEngine.from_engine_args(args))

    # ---- public ----

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._closed

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                       priority: int = 0, session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; ValueError if the engine rejects it (nothing else changes)."""
        outputs = await self.add_request(request_id, prompt, params, priority, session_id)
        async for out in outputs:
            yield out

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          priority: int = 0, session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request (ValueError if rejected) and returns its output stream, which the caller must
        iterate or close: leaving the stream before the request finishes aborts it."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        try:
            await self.call(lambda: self._add(request_id, prompt, params, priority, session_id, stream))
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run; this abort is queued after it
            raise
        return self._iterate(request_id, stream)

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
        """Thread-safe and idempotent; a consumer still iterating sees its stream end."""
        if not self._closed:
            self._commands.put(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the engine thread between steps (tokenizer and engine state are safe there)."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def stats(self):
        return await self.call(self.engine.stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still in flight end with EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    # ---- engine thread ----

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"The engine loop failed: {self._error!r}") from self._error
        if self._closed:
            raise EngineDeadError("The engine is shut down.")

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams | None, priority: int,
             session_id: str | None, stream: _Stream) -> None:
        self.engine.add_request(request_id, prompt, params, priority=priority, session_id=session_id)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _ABORTED)

    def _build_and_loop(self, engine: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:  # noqa: BLE001 — handed to the constructor's caller
            self._closed = True
            built.set_exception(e)
            return
        built.set_result(self.engine)
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._run_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as e:  # noqa: BLE001 — every waiting caller must hear of it
            logger.exception("engine loop failed")
            self._error = e
            self._fail_all(EngineDeadError(f"The engine loop failed: {e!r}"))
            return
        self._fail_all(EngineDeadError("The engine is shut down."))

    def _run_commands(self, block: bool) -> bool:
        """Runs queued commands (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            self._run(command)

    @staticmethod
    def _run(command: Any) -> None:
        if not isinstance(command, tuple):
            command()
            return
        fn, future = command
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as e:  # noqa: BLE001 — handed to the caller, e.g. a ValueError from add_request
            future.set_exception(e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
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
        while True:  # callers waiting on a command future
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, tuple) and command[1].set_running_or_notify_cancel():
                command[1].set_exception(error)
        for stream in self._streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
