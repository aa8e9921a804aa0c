"""Request and response bodies of OpenAI's Responses API (/v1/responses), the text part that vLLM 0.32 serves.

A request is read as a chat request (`ResponsesRequest.to_chat`): its `instructions` become the system message, its
input items chat messages (text content, earlier function calls and their outputs), its function tools the chat's
tools. What it asks for beyond that (built-in tools, background runs, server-side conversations, images and files)
is a 400 naming the field, as everywhere in this server.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.entrypoints.openai.protocol import (
    EngineInt,
    HashableFailFast,
    OpenAIModel,
    Priority,
    ReasoningEffort,
    Seed,
    Texts,
    TokenIds,
    Unsupported,
    given_field,
    nonempty_field,
)


def response_id(prefix: str) -> str:
    """OpenAI's ids here: a type prefix, an underscore, hex (`resp_...`, `msg_...`, `fc_...`, `rs_...`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _builtin_tools(tools: Any) -> bool:
    return isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") != "function" for t in tools)


_UNSUPPORTED: Unsupported = {
    "background": (nonempty_field, "background responses are not supported; send the request and wait for it"),
    "conversation": (given_field, "server-side conversations are not supported; continue with previous_response_id"),
    "prompt": (given_field, "stored prompt templates are not supported; send the input itself"),
    "include": (nonempty_field, "no extra output data (logprobs, encrypted reasoning, tool results) can be included"),
    "truncation": (lambda v: v not in (None, "disabled"), 'only "disabled" is supported: a conversation too long '
                                                         "for the context is a 400"),
    "tools": (_builtin_tools, "only function tools are supported (no built-in web search, file search, code "
                              "interpreter, computer use or MCP)"),
}


# ---- input items ----

def _text_or_list_kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


def _text_or_list(item: Any, min_items: int = 0) -> Any:
    """A text or a list of `item`: told apart before validation, so that an error names what is wrong in the list
    (a union would report first that the list is no text)."""
    listed = Annotated[list[item], Tag("list"), HashableFailFast(), Field(min_length=min_items)]
    return Annotated[Annotated[str, Tag("text")] | listed, Discriminator(_text_or_list_kind)]


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier assistant message given back
    text: str


TextContent = _text_or_list(InputText)


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextContent

    def chat_message(self) -> dict[str, Any]:
        # most chat templates know no "developer" role: its instructions are the system's
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        return {"role": role, "content": [{"type": "text", "text": part.text} for part in self.content]}


class FunctionCallInput(OpenAIModel):
    """An earlier output's function call, given back so that its output can follow."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    def tool_call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutput(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: TextContent

    def chat_message(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


class ReasoningInput(OpenAIModel):
    """An earlier output's reasoning, given back: not rendered again (chat templates drop past reasoning too)."""
    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unknown"


class _UnknownItem(OpenAIModel):
    type: Literal["message", "function_call", "function_call_output", "reasoning"]  # fails: names the choices


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")] | Annotated[ReasoningInput, Tag("reasoning")]
    | Annotated[_UnknownItem, Tag("unknown")],
    Discriminator(_item_type)]


Input = _text_or_list(InputItem, min_items=1)  # a text is the user's message


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """The input items as chat messages; consecutive function calls join one assistant message's tool_calls (the
    assistant message just before them, if there is one), as a chat client sends them."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallInput):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(item.tool_call())
        elif isinstance(item, InputMessage | FunctionCallOutput):
            messages.append(item.chat_message())
    return messages


# ---- tools, text format, reasoning ----

class FunctionTool(OpenAIModel):
    """The Responses API's function tool: the chat tool's function fields, flat."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.json_schema,
                                                       "strict": self.strict}}


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(OpenAIModel):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # no summaries are written: the reasoning item carries the reasoning text itself


# ---- the request ----

class ResponsesRequest(OpenAIModel):
    unsupported_fields: ClassVar[Unsupported] = _UNSUPPORTED
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: EngineInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extra sampling fields, as on chat
    top_k: EngineInt | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | Texts | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: EngineInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    thinking_token_budget: int | None = None
    priority: Priority | None = None
    cache_salt: str | None = None

    # the fields the chat request takes as they are (the chat request validates them)
    _PASSED: ClassVar[tuple[str, ...]] = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k",
                                          "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                                          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                                          "thinking_token_budget", "priority", "cache_salt")

    def cost(self) -> RequestCost:
        tokens = self.max_output_tokens
        return RequestCost(prompts=1, prompts_param="input", output_param="max_output_tokens",
                           output_tokens=None if tokens is None else max(tokens, 0))

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's own turn as chat messages (not its instructions, which a continuation does not keep)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return chat_messages(self.input)

    def to_chat(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request body of this request after the conversation `history` (its earlier turns' messages):
        validated by ChatCompletionRequest, whose rules then hold here too."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body: dict[str, Any] = {name: getattr(self, name) for name in self._PASSED if getattr(self, name) is not None}
        body |= {"messages": system + history + self.input_messages(), "stream": False,
                 "max_completion_tokens": self.max_output_tokens}
        if self.tools:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.response_format() is not None:
            body["response_format"] = self.text.format.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return body


# ---- the response ----

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: response_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: response_id("rs"))
    status: Status = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: response_id("fc"))
    status: Status = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None

    @classmethod
    def of(cls, rid: str, model: str, req: ResponsesRequest) -> ResponseObject:
        """The response to `req`, still without output: what it echoes of the request."""
        return cls(id=rid, model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                   temperature=req.temperature, top_p=req.top_p,
                   tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                   tool_choice=_echoed_choice(req), parallel_tool_calls=req.parallel_tool_calls,
                   previous_response_id=req.previous_response_id, store=req.store,
                   text={"format": (req.text.format if req.text else TextFormat()).model_dump(by_alias=True,
                                                                                             exclude_none=True)},
                   reasoning=req.reasoning.model_dump() if req.reasoning else None, metadata=req.metadata or {},
                   user=req.user)


def _echoed_choice(req: ResponsesRequest) -> Any:
    if isinstance(req.tool_choice, NamedFunction):
        return req.tool_choice.model_dump()
    return req.tool_choice or ("auto" if req.tools else "none")
