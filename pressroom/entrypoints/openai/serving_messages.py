"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM 0.32 serves it, on the chat handler.

A request becomes a chat request (protocol_messages.py: `to_chat`) that `OpenAIServingChat.start` adds to the engine;
its output is read as chat reads it (the reasoning parser's split, the tool-call parser's calls) and told as Anthropic
tells it: thinking, text and tool_use blocks, a stop_reason (end_turn, max_tokens, stop_sequence with the sequence
matched, tool_use) and usage. Whole, or streamed as Anthropic's events, each `event: NAME` and its data: message_start,
ping, then for each block content_block_start, its deltas (text_delta, thinking_delta, input_json_delta) and
content_block_stop; last message_delta (stop_reason, usage) and message_stop. Every error, on the stream too, has
Anthropic's shape.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall
from pressroom.entrypoints.openai.protocol_messages import (
    ContextManagement,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    error_body,
    message_id,
)
from pressroom.entrypoints.openai.serving import EventStream
from pressroom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat, chat_request_from, split_delta
from pressroom.entrypoints.openai.streams import ERROR, FAILED_MESSAGE, collect_finals, merge_streams, with_disconnect
from pressroom.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("pressroom")

MESSAGES_PATH = "/v1/messages"  # and its count_tokens below it: their errors have Anthropic's shape


def messages_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


class OpenAIServingMessages(OpenAIServingChat):
    """The chat handler, answering in the Messages API's shapes."""

    async def messages(self, request: Request) -> Response:
        try:
            return await self._messages(request)
        except APIError as e:
            return messages_error(e.status, e.message)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as /v1/messages would render it (its input_tokens)."""
        try:
            req = await self._parse(request, CountTokensRequest)
            chat = chat_request_from(req.to_chat())
            self._check_model(chat.model)
            tools = [tool.model_dump(exclude_none=True) for tool in chat.tools or []] or None
            ids = await self._chat_ids(chat.messages, True, False, chat.template_kwargs, None, tools)
        except APIError as e:
            return messages_error(e.status, e.message)
        count = len(ids)
        return JSONResponse(CountTokensResponse(input_tokens=count, context_management=ContextManagement(
            original_input_tokens=count)).model_dump())

    async def _messages(self, request: Request) -> Response:
        req = await self._parse(request, MessagesRequest)
        chat = chat_request_from(req.to_chat())
        self._admit(chat.cost())
        mid = message_id()
        run = await self.start(request, chat, mid)
        if req.stream:
            return EventStream(self._events(mid, req.model, run), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = (await with_disconnect(request, collect_finals([run.stream])))[0]
        return JSONResponse(self._message(mid, req.model, out, chat, run).model_dump())

    def _message(self, mid: str, model: str, out: RequestOutput, chat: ChatCompletionRequest,
                 run: ChatRun) -> MessagesResponse:
        c = out.outputs[0]
        message = self._choice(c, chat, run.opens, run.tools).message
        content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
        if message.reasoning:
            content.append(ThinkingBlock(thinking=message.reasoning))
        if message.content:
            content.append(TextBlock(text=message.content))
        content += [ToolUseBlock(id=call.id, name=call.function.name, input=_tool_input(call.function.arguments))
                    for call in message.tool_calls or []]
        reason, sequence = stop_reason(c, bool(message.tool_calls))
        return MessagesResponse(id=mid, model=model, content=content, stop_reason=reason, stop_sequence=sequence,
                                usage=MessagesUsage(input_tokens=len(out.prompt_token_ids),
                                                    output_tokens=len(c.token_ids)))

    async def _events(self, mid: str, model: str, run: ChatRun) -> AsyncIterator[str]:
        """The streamed message; a failure midway ends it with an error event, never with a cut connection."""
        try:
            async for event in self._message_events(mid, model, run):
                yield event
        except EngineDeadError as e:  # the engine ended the request (shutdown, or the core died)
            yield _error_event(503, str(e))
        except Exception:  # noqa: BLE001 — a fault of this one stream: it ends with an error, the rest go on
            logger.exception("a /v1/messages stream's handler failed")
            yield _error_event(500, FAILED_MESSAGE)

    async def _message_events(self, mid: str, model: str, run: ChatRun) -> AsyncIterator[str]:
        start = MessagesResponse(id=mid, model=model, content=[],
                                 usage=MessagesUsage(input_tokens=len(run.prompt_ids), output_tokens=0))
        yield event("message_start", message=start.model_dump())
        yield event("ping")
        blocks = _Blocks()
        splitters = [self.reasoning.stream(run.opens)] if self.reasoning is not None else None
        callers = [run.tools.make_stream()] if run.tools.make_stream is not None else None
        sent, final = 0, None
        async for _, out in merge_streams([run.stream]):
            c = out.outputs[0]
            reasoning, text, calls = split_delta(c.text[sent:], c.finish_reason is not None, splitters, callers, 0)
            sent = len(c.text)
            for e in blocks.thinking(reasoning) + blocks.text(text) + [e for call in calls for e in blocks.call(call)]:
                yield e
            final = out if out.finished else final
        if final is None or final.outputs[0].finish_reason == ERROR:
            yield _error_event(503 if final is None else 500,
                               "The request was aborted." if final is None else FAILED_MESSAGE)
            return
        c = final.outputs[0]
        for e in blocks.stop():
            yield e
        reason, sequence = stop_reason(c, callers is not None and callers[0].calls_begun > 0)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage={"input_tokens": len(final.prompt_token_ids), "output_tokens": len(c.token_ids)})
        yield event("message_stop")


class _Blocks:
    """The content blocks of one streamed message: a block starts on its first delta and stops when the next one
    starts or the message ends; its events carry its index."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def thinking(self, delta: str) -> list[str]:
        return self._delta(ThinkingBlock(thinking=""), {"type": "thinking_delta", "thinking": delta}) if delta else []

    def text(self, delta: str) -> list[str]:
        return self._delta(TextBlock(text=""), {"type": "text_delta", "text": delta}) if delta else []

    def call(self, call: DeltaToolCall) -> list[str]:
        """A call's first delta (its id and name) starts a tool_use block; its arguments come as partial JSON."""
        events = self._start(ToolUseBlock(id=call.id, name=call.function.name or "", input={})) \
            if call.id is not None else []
        if call.function.arguments:
            events.append(self._delta_event({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", index=self.index)]

    def _delta(self, block: TextBlock | ThinkingBlock, delta: dict[str, Any]) -> list[str]:
        events = self._start(block) if self.kind != block.type else []
        return events + [self._delta_event(delta)]

    def _start(self, block: TextBlock | ThinkingBlock | ToolUseBlock) -> list[str]:
        events = self.stop()
        self.index, self.kind = self.index + 1, block.type
        return events + [event("content_block_start", index=self.index, content_block=block.model_dump())]

    def _delta_event(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.index, delta=delta)


def event(kind: str, **fields: Any) -> str:
    """One server-sent event as Anthropic sends it: its type named on the event line and in its data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def _error_event(status: int, message: str) -> str:
    return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"


def stop_reason(output: CompletionOutput, called: bool) -> tuple[StopReason, str | None]:
    """Why the output ended, in Anthropic's words, and the stop sequence it ended on (None for any other reason)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(output.stop_reason, str):  # a stop string matched (a stop token id is an int)
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input object; arguments that are no JSON object (a model's malformed call)
    are kept as their text under "arguments" rather than dropped."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}
