"""Request and response bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as vLLM
0.32 serves it.

A request is run as a chat request (`to_chat`): `system` becomes the system message, a user's tool_result blocks tool
messages, an assistant's tool_use blocks its tool_calls, `tools` chat tools (input_schema their parameters) and
`tool_choice` chat's (any: required, tool: the named function), `output_config` chat's response_format (its JSON
schema) and reasoning_effort. Thinking blocks sent back in an assistant turn are
accepted and left out of the prompt, as chat templates leave out past reasoning. Errors have Anthropic's shape:
{"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pressroom.entrypoints.openai.protocol import EngineInt, HashableFailFast, OpenAIModel, Texts

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# The block types a message may hold here, by role; others (images, documents) are refused by name.
_BLOCKS_OF = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# ---- requests ----

class ContentBlock(OpenAIModel):
    """A block of a message's content: text, an assistant's earlier tool call (tool_use, with its id, name and
    input), a user's result of one (tool_result: the call's id and its content), or an assistant's thinking."""
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def fields_of_its_type(self) -> ContentBlock:
        needed = {"text": ("text",), "tool_use": ("id", "name"), "tool_result": ("tool_use_id",)}.get(self.type, ())
        for name in needed:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} block needs `{name}`")
        return self

    def result_text(self) -> str:
        """A tool_result's content as text (its text blocks joined by newlines)."""
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"a tool_result's content takes text blocks only; got type {part.get('type')!r}")
        return "\n".join(part["text"] for part in self.content)


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def blocks_of_its_role(self) -> AnthropicMessage:
        allowed = _BLOCKS_OF[self.role]
        for block in self.content if isinstance(self.content, list) else ():
            if block.type not in allowed:
                raise ValueError(f"{block.type!r} blocks are not supported in a {self.role} message here (it takes "
                                 f"{', '.join(allowed)}): pressroom serves text")
            if block.type == "tool_result":
                block.result_text()  # its parts checked now: a 400 naming this message
        return self

    def to_chat(self) -> list[dict[str, Any]]:
        """This message as chat messages: a user's tool results each a tool message, ahead of the rest of its
        content; an assistant's tool_use blocks its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = self.content
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                   for b in blocks if b.type == "tool_result"]
        message: dict[str, Any] = {"role": self.role,
                                   "content": [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
                 for b in blocks if b.type == "tool_use"]
        if calls:
            message["tool_calls"] = calls
        return results + ([message] if message["content"] or calls or not results else [])


class AnthropicTool(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema of the input object

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class AnthropicToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def tool_has_a_name(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice {"type": "tool"} needs the tool\'s `name`')
        return self

    def to_chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class CountTokensRequest(OpenAIModel):
    """A conversation: what /v1/messages/count_tokens counts, and the prompt of a /v1/messages request."""
    model: str = Field(min_length=1)
    messages: Annotated[list[AnthropicMessage], HashableFailFast()] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra field: template variables

    @field_validator("system")
    @classmethod
    def system_is_text(cls, system: str | list[ContentBlock] | None) -> str | list[ContentBlock] | None:
        for block in system if isinstance(system, list) else ():
            if block.type != "text":
                raise ValueError(f"`system` takes text blocks only; got type {block.type!r}")
        return system

    def to_chat(self) -> dict[str, Any]:
        """The body of the chat request this one runs as."""
        messages = [m for message in self.messages for m in message.to_chat()]
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                [{"type": "text", "text": block.text} for block in self.system]
            messages.insert(0, {"role": "system", "content": system})
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools is not None:
            body["tools"] = [tool.to_chat() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.to_chat()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel's


class OutputConfig(OpenAIModel):
    """Anthropic's output_config: a JSON schema the output follows (chat's response_format) and an effort (chat's
    reasoning_effort, a template variable)."""
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None

    def to_chat(self) -> dict[str, Any]:
        body: dict[str, Any] = {} if self.effort is None else {"reasoning_effort": self.effort}
        if self.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.format.json_schema}}
        return body


class MessagesRequest(CountTokensRequest):
    max_tokens: EngineInt = Field(ge=1)  # required, as Anthropic's API requires it
    temperature: float | None = None
    top_p: float | None = None
    top_k: EngineInt | None = None
    stop_sequences: Texts | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # Anthropic's user_id: accepted, not read
    output_config: OutputConfig | None = None

    def to_chat(self) -> dict[str, Any]:
        body = super().to_chat() | {"max_tokens": self.max_tokens}
        if self.output_config is not None:
            body |= self.output_config.to_chat()
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "stop": self.stop_sequences}
        return body | {k: v for k, v in sampling.items() if v is not None}


# ---- responses ----

class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; a local model's is not signed


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    input_tokens: int  # the prompt's tokens, as vLLM counts them (cached ones included)
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class ContextManagement(BaseModel):
    """What context management did to the prompt before counting; none runs here, so the count is the original's
    (vLLM 0.32 answers it the same way)."""
    original_input_tokens: int


class CountTokensResponse(BaseModel):
    input_tokens: int
    context_management: ContextManagement | None = None


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    known = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}
    return known.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=error_type(status), message=message)).model_dump()
