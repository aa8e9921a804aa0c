"""Calls under tool_choice "required" or a named function: the output was constrained (structured outputs)
to JSON, so it is read as JSON, never by the server's text parser.

- required: `[{"name": ..., "parameters": {...}}, ...]`, one object per call (`required_schema`);
- named: the output is the arguments object of that function (`named_schema`), streamed as it comes.
"""
from __future__ import annotations

from typing import Any

from pressroom.entrypoints.openai.protocol import ChatTool
from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream
from pressroom.entrypoints.openai.tool_parsers.json_sequence import JsonCallSequence

_ANY_OBJECT = {"type": "object", "properties": {}}


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """An array of at least one call (exactly one without parallel calls), each naming a tool with its
    parameters' schema."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": parameters_schema(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return schema | ({} if parallel else {"maxItems": 1})


def named_schema(tool: ChatTool) -> dict[str, Any]:
    return parameters_schema(tool)


class RequiredToolStream(ToolCallStream):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._calls = JsonCallSequence(self, ("parameters",), opening="[", separator=",", closing="]")

    def _feed(self, delta: str) -> None:
        self._calls.feed(delta)

    def _finish(self) -> None:
        self._calls.finish()


class NamedToolStream(ToolCallStream):
    """The whole output is the arguments of one call to `name`; its text goes out as it comes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _feed(self, delta: str) -> None:
        if not self.calls_begun:
            self.begin_call(self.name)
        self.add_arguments(delta)

    def _finish(self) -> None:
        if not self.calls_begun:
            self.begin_call(self.name)
