"""`qwen3_coder`: Qwen3-Coder's XML-like calls, after any content:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Its chat template writes a value that is an object or an array as JSON and anything else as text (a string as
it is, True/False/None and numbers as Python prints them), so a value's type is read from the tool's JSON schema
when the request's tools are given (`tools=`), and otherwise guessed: JSON (and Python's True/False/None) when the
text is a JSON literal, an object or an array, else the text. One newline after `<parameter=KEY>` and one before
`</parameter>` belong to the markup.
"""
from __future__ import annotations

import json
import re
from typing import Any

from pressroom.entrypoints.openai.tool_parsers.marked import Call, MarkedCallStream

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


class Qwen3CoderToolStream(MarkedCallStream):
    OPENS = ("<tool_call>",)
    CLOSE = "</tool_call>"

    def __init__(self, parallel: bool = True, tools: list[Any] | None = None) -> None:
        super().__init__(parallel)
        self._types = _parameter_types(tools or [])  # {function: {parameter: JSON schema type}}

    @classmethod
    def for_request(cls, parallel: bool, tools: list[Any]) -> Qwen3CoderToolStream:
        return cls(parallel, tools)

    def parse(self, body: str) -> list[Call] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, params = function.group(1).strip(), function.group(2)
        types = self._types.get(name, {})
        arguments, at = {}, 0
        while (parameter := _PARAMETER.match(params, at)) is not None:
            key = parameter.group(1).strip()
            arguments[key] = _value(parameter.group(2), types.get(key))
            at = parameter.end()
        if params[at:].strip():
            return None
        return [Call(name, json.dumps(arguments, ensure_ascii=False))]


def _parameter_types(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Each function's parameters' schema `type`, from ChatTool models or their dicts."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        tool = tool.model_dump() if hasattr(tool, "model_dump") else tool
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        out[function.get("name", "")] = {k: (v or {}).get("type") for k, v in properties.items()}
    return out


def _value(text: str, schema_type: Any) -> Any:
    """The argument value written as `text`, typed by its schema type when known."""
    kinds = set(schema_type) if isinstance(schema_type, list) else {schema_type} if schema_type else set()
    if kinds == {"string"}:
        return text
    if text.strip() in _PYTHON_LITERALS and (not kinds or kinds & {"boolean", "null"}):
        return _PYTHON_LITERALS[text.strip()]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(value, str) or (kinds and not _fits(value, kinds)):
        return text  # a string is written bare: quotes in it are its own
    return value


def _fits(value: Any, kinds: set[str]) -> bool:
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
    return any(checks[k](value) for k in kinds if k in checks)
