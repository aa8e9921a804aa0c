"""The engine's output streams as the handlers consume them: several merged into one, collected to their
final outputs, cancelled when the client goes away, and checked for a request whose output handling failed."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.outputs import RequestOutput

T = TypeVar("T")

FAILED_MESSAGE = ("The server failed while processing this request's output; the request was ended (other "
                  "requests are not affected).")
ERROR = "error"  # the finish reason of a request whose output handling failed (LLMEngine.process_outputs)


def raise_if_failed(outputs) -> None:
    """A 500 for a request one of whose outputs ended with finish_reason "error" (its handling failed in the
    engine's front-end; the engine logged why)."""
    if any(c.finish_reason == ERROR for out in outputs for c in out.outputs):
        raise APIError(500, FAILED_MESSAGE, "internal_server_error")


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come; leaving early closes (aborts) them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each stream, in order; a 503 if any stream ended without one (aborted, or the
    engine ended it), a 500 if one failed (finish_reason "error")."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_streams(streams):
            if out.finished:
                finals[i] = out
    except EngineDeadError as e:  # the core died, or the server's shutdown ended the request
        raise APIError(503, str(e), "service_unavailable") from None
    if len(finals) != len(streams):
        raise APIError(503, "The request was aborted.", "service_unavailable")
    raise_if_failed(finals.values())
    return [finals[i] for i in range(len(streams))]


async def with_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and so aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # lets its streams abort their requests
    if task.cancelled():
        raise APIError(499, "The client closed the request.")
    return task.result()
