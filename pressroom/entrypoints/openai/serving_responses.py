"""/v1/responses: OpenAI's Responses API, as vLLM 0.32 serves it for text, on the chat handler.

A request becomes a chat request (`ResponsesRequest.to_chat`: instructions the system message, input items chat
messages, function tools chat tools, max_output_tokens max_completion_tokens) that `OpenAIServingChat.start` adds to
the engine. Its output is read as chat reads it (the reasoning parser's split, the tool-call parser's calls) and told
as the Responses API tells it: a reasoning item, a message item holding output_text, function_call items. Whole, or
streamed as events: response.created, response.in_progress, then for each item output_item.added,
content_part.added (text items), its deltas and their done event, content_part.done, output_item.done; last
response.completed, or response.incomplete where max_output_tokens cut the output.

`previous_response_id` continues a stored response's conversation: its messages (every turn's input and output, not
its instructions, which OpenAI's API does not carry over) go before the new input. Responses are kept (`store`, true
by default) in memory, the oldest dropped past MAX_STORED_RESPONSES; GET /v1/responses/{id} returns a kept one.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall
from pressroom.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    response_id,
)
from pressroom.entrypoints.openai.serving import EventStream
from pressroom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat, chat_request_from, split_delta
from pressroom.entrypoints.openai.streams import ERROR, FAILED_MESSAGE, collect_finals, with_disconnect
from pressroom.outputs import RequestOutput

# Each kept response holds at most about two contexts' worth of text (its prompt fitted max_model_len, and so did its
# output), and the messages of a conversation's turns are shared between its responses, not copied.
MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # the chat messages of every turn so far, this response's output last


class ResponseStore:
    """The kept responses by id, the oldest dropped past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, rid: str) -> StoredResponse | None:
        return self._kept.get(rid)

    def put(self, stored: StoredResponse) -> None:
        self._kept[stored.response.id] = stored
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)


class OpenAIServingResponses(OpenAIServingChat):
    """The chat handler, answering in the Responses API's shapes, with the responses it keeps."""
    forced_tools_need_parser = False  # vLLM's Responses API takes a required or named tool_choice without a parser

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept = ResponseStore()

    async def create_response(self, request: Request) -> Response:
        req = await self._parse(request, ResponsesRequest)
        history = self._conversation(req.previous_response_id)
        chat = chat_request_from(req.to_chat(history))
        response = ResponseObject.of(response_id("resp"), req.model or self.names[0], req)
        try:
            self._admit(chat.cost())
            run = await self.start(request, chat, response.id)
        except APIError as e:  # the chat's rules name the chat's fields: this request's are named instead
            e.param = _OWN_NAMES.get(e.param, e.param)
            raise
        turn = Turn(req, run, history + req.input_messages())
        if req.stream:
            return EventStream(self._events(turn, response), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = (await with_disconnect(request, collect_finals([run.stream])))[0]
        response.output = self._output_items(out, chat, run)
        self._complete(turn, response, out)
        return JSONResponse(response.model_dump())

    async def retrieve_response(self, response_id: str) -> dict:
        """GET /v1/responses/{response_id}: a kept response."""
        return self._stored(response_id, "response_id").response.model_dump()

    def _conversation(self, previous_id: str | None) -> list[dict[str, Any]]:
        return [] if previous_id is None else self._stored(previous_id, "previous_response_id").conversation

    def _stored(self, rid: str, param: str) -> StoredResponse:
        stored = self.kept.get(rid)
        if stored is None:
            raise APIError(404, f"Response with id '{rid}' not found (responses sent with store false are not kept, "
                                f"and only the last {self.kept.capacity} are).", param=param, code="not_found")
        return stored

    def _output_items(self, out: RequestOutput, chat: ChatCompletionRequest, run: ChatRun) -> list[OutputItem]:
        """The whole output as items: its reasoning, its message (if it has content, or calls nothing), its calls."""
        message = self._choice(out.outputs[0], chat, run.opens, run.tools).message
        items: list[OutputItem] = []
        if message.reasoning:
            items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning)]))
        if message.content or not message.tool_calls:
            items.append(OutputMessage(content=[OutputText(text=message.content or "")]))
        items += [FunctionCallItem(call_id=call.id, name=call.function.name, arguments=call.function.arguments)
                  for call in message.tool_calls or []]
        for item in items:
            item.status = "completed"
        if items:
            items[-1].status = _status(out)  # the item the output ended in is the one a length limit cut
        return items

    def _complete(self, turn: Turn, response: ResponseObject, out: RequestOutput) -> None:
        """Fills in the finished response's status and usage, and keeps it if asked to."""
        response.status = _status(out)
        if response.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        usage = self._chat_usage(out, turn.run.opens)
        details = usage.completion_tokens_details
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0))
        if turn.req.store:
            self.kept.put(StoredResponse(response, turn.conversation + [_assistant_message(response.output)]))

    async def _events(self, turn: Turn, response: ResponseObject) -> AsyncIterator[str]:
        """The streamed response: its events as server-sent events (`event: <type>` and the event as data)."""
        events = _Events(response)
        splitters = [self.reasoning.stream(turn.run.opens)] if self.reasoning is not None else None
        callers = [turn.run.tools.make_stream()] if turn.run.tools.make_stream is not None else None
        sent, final = 0, None
        try:
            async with aclosing(turn.run.stream) as stream:  # left early (the client gone): the request is aborted
                yield events.response("response.created")
                yield events.response("response.in_progress")
                async for out in stream:
                    c = out.outputs[0]
                    reasoning, content, calls = split_delta(c.text[sent:], c.finish_reason is not None, splitters,
                                                            callers, 0)
                    sent = len(c.text)
                    for event in events.text("reasoning", reasoning) + events.text("message", content) + \
                            [e for call in calls for e in events.call(call)]:
                        yield event
                    final = out if out.finished else final
        except EngineDeadError as e:  # the engine ended the request (shutdown, or the core died)
            yield events.error(str(e), "service_unavailable")
            return
        if final is None or final.outputs[0].finish_reason == ERROR:
            yield events.error("The request was aborted." if final is None else FAILED_MESSAGE, "server_error")
            return
        for event in events.finish(_status(final)):
            yield event
        self._complete(turn, response, final)
        yield events.response("response.completed" if response.status == "completed" else "response.incomplete")


@dataclass(frozen=True, slots=True)
class Turn:
    """One Responses request on its way: the request, its chat run, and the conversation up to its output."""
    req: ResponsesRequest
    run: ChatRun
    conversation: list[dict[str, Any]]


class _Events:
    """The events of one streamed response, numbered as they go out. An item opens on its first text (or a call's
    first delta) and is done when the next one opens or the output ends; `response.output` grows with them."""

    def __init__(self, response: ResponseObject) -> None:
        self.response_ = response
        self.sequence = 0
        self.item: OutputItem | None = None  # the item open now

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def response(self, kind: str) -> str:
        return self.event(kind, response=self.response_.model_dump(mode="json"))

    def error(self, message: str, code: str) -> str:
        return self.event("error", code=code, message=message, param=None)

    def text(self, kind: str, delta: str) -> list[str]:
        """`delta` of the reasoning ("reasoning") or the message ("message"), opening its item if need be."""
        if not delta:
            return []
        opened = [] if self.item is not None and self.item.type == kind else self._open(
            ReasoningItem(content=[ReasoningText()]) if kind == "reasoning" else OutputMessage(content=[OutputText()]))
        part = self.item.content[0]
        part.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return opened + [self.event(name, **self._where(), content_index=0, delta=delta, **extra)]

    def call(self, delta: DeltaToolCall) -> list[str]:
        """A tool-call delta: its first (id and name) opens a function_call item, the rest add to its arguments."""
        opened = []
        if delta.id is not None:
            opened = self._open(FunctionCallItem(call_id=delta.id, name=delta.function.name or ""))
        fragment = delta.function.arguments or ""
        if not fragment:
            return opened
        self.item.arguments += fragment
        return opened + [self.event("response.function_call_arguments.delta", **self._where(), delta=fragment)]

    def finish(self, status: str) -> list[str]:
        """The output ended: the open item is done with `status`; an output with no message and no call gets an
        empty message (as the whole response has)."""
        events = []
        if not any(isinstance(item, OutputMessage | FunctionCallItem) for item in self.response_.output):
            events = self._open(OutputMessage(content=[OutputText()]))
        return events + self._close(status)

    def _open(self, item: OutputItem) -> list[str]:
        events = self._close("completed")
        self.response_.output.append(item)
        self.item = item
        parts = [] if isinstance(item, FunctionCallItem) else item.content
        if parts:
            item.content = []  # the item is announced empty, then each part, then the parts' deltas
        events.append(self.event("response.output_item.added", output_index=self._index(),
                                 item=item.model_dump(mode="json")))
        for part in parts:
            item.content.append(part)
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=part.model_dump(mode="json")))
        return events

    def _close(self, status: str) -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": self.response_.output.index(item)}
        if isinstance(item, FunctionCallItem):
            events = [self.event("response.function_call_arguments.done", **where, arguments=item.arguments)]
        else:
            part = item.content[0]
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=part.text) \
                if isinstance(item, ReasoningItem) else \
                self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
            events = [done, self.event("response.content_part.done", **where, content_index=0,
                                       part=part.model_dump(mode="json"))]
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=item.model_dump(mode="json"))]

    def _index(self) -> int:
        return len(self.response_.output) - 1

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item.id, "output_index": self._index()}


# the chat request's fields by the names they have in a Responses request
_OWN_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def _assistant_message(output: list[OutputItem]) -> dict[str, Any]:
    """A response's output as the assistant message its conversation goes on from (its reasoning left out, as chat
    templates leave out past reasoning)."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCallItem)]
    if calls:
        message["tool_calls"] = calls
    return message
