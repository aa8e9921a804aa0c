"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` mean for it (`plan_tools`).

- "none" (the default without tools): no calls are parsed; the tools still reach the chat template, as vLLM
  gives them (a template may describe them; the model is just not asked to call one).
- "auto" (the default with tools): the server's `--tool-call-parser` reads calls out of free text; a server
  started without `--enable-auto-tool-choice` answers 400, as vLLM does.
- "required" and a named function: the output is constrained to JSON by structured outputs (an array of
  calls, or the named function's arguments), so it always parses; it is read as JSON, not by the text parser.
  Still, a server started without `--tool-call-parser` answers 400 naming the flag, as vLLM 0.32 does (a vLLM
  client relies on that refusal; the parser need not be the model's own).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from pressroom.entrypoints.openai.tool_parsers import (
    NamedToolStream,
    RequiredToolStream,
    ToolCallStream,
    named_schema,
    required_schema,
)

AUTO_NEEDS_FLAGS = ('"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                    '--tool-call-parser; send tool_choice "required", "none" or a named function instead')


@dataclass(slots=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None = None  # the `tools` variable of the chat template
    schema: dict[str, Any] | None = None  # the JSON schema the output is constrained to (required, named)
    make_stream: Callable[[], ToolCallStream] | None = None  # None: the output is not parsed for calls
    auto: bool = False  # parsed by the server's --tool-call-parser (tool_choice "auto")


def plan_tools(req: ChatCompletionRequest, auto_parser: type[ToolCallStream] | None,
               parser_named: bool = True) -> ToolPlan:
    """The request's plan; a 400 naming `tool_choice` for a choice it cannot have. `auto_parser`: the
    server's --tool-call-parser when --enable-auto-tool-choice is on, else None; `parser_named`: whether the
    server was started with --tool-call-parser at all (vLLM refuses "required" and named choices without it)."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "`tool_choice` needs `tools`: there is no tool to call.", param="tool_choice")
    plan = ToolPlan(template_tools=[t.model_dump(exclude_none=True) for t in tools] or None)
    parallel = req.parallel_tool_calls
    if choice not in ("auto", "none") and not parser_named:
        raise APIError(400, f"tool_choice={_choice_words(choice)} requires --tool-call-parser to be set.",
                       param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS + ".", param="tool_choice")
        plan.make_stream, plan.auto = (lambda: auto_parser.for_request(parallel, tools)), True
    elif choice == "required":
        plan.schema = required_schema(tools, parallel)
        plan.make_stream = lambda: RequiredToolStream(parallel)
    elif choice != "none":
        tool = _named_tool(tools, choice.function.name)
        plan.schema = named_schema(tool)
        plan.make_stream = lambda: NamedToolStream(tool.function.name)
    return plan


def _choice_words(choice) -> str:
    """A required or named choice as vLLM's refusal names it: `"required"`, or `function "NAME"`."""
    return f'"{choice}"' if isinstance(choice, str) else f'function "{choice.function.name}"'


def _named_tool(tools: list[ChatTool], name: str) -> ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise APIError(400, f"`tool_choice` names the function {name!r}, which is not among `tools`.",
                   param="tool_choice")
