"""Tool-call parsers on fixed strings: the calls and content of whole outputs, and the same result for the
output streamed in any split (every one-cut and two-cut split), with each call's deltas in OpenAI's shape."""
from __future__ import annotations

import json

import pytest

from pressroom.entrypoints.openai.protocol import ChatTool
from pressroom.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolStream,
    Llama3JsonToolStream,
    NamedToolStream,
    RequiredToolStream,
    assemble,
    extract,
    required_schema,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'

HERMES = [  # (output, content, [(name, arguments)])
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.", [("get_weather", WEATHER_ARGS)]),
    (f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>', None,
     [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    (f"<tool_call>{WEATHER}", None, [("get_weather", WEATHER_ARGS)]),  # the output ended on the JSON
    ('<tool_call>{"name": "f", "parameters": {"x": [1, {"y": "</"}]}}</tool_call>', None,
     [("f", '{"x": [1, {"y": "</"}]}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>', None, [("f", '{"q": "é"}')]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("no calls here, a < b and <tool", "no calls here, a < b and <tool", []),
    ('<tool_call>{"name": "f", "arguments": {"a": }</tool_call> after',  # malformed: content, tags included
     '<tool_call>{"name": "f", "arguments": {"a": }</tool_call> after', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut off mid-call
    (f"<tool_call>bad</tool_call> then <tool_call>{WEATHER}</tool_call>", "<tool_call>bad</tool_call> then",
     [("get_weather", WEATHER_ARGS)]),
    ("  \n", "  \n", []),
    ("", None, []),
]

LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"x": [1, 2]}'), ("g", "{}")]),
    (' {"name": "f", "arguments": {"s": "a;b}"}} ;', None, [("f", '{"s": "a;b}"}')]),
    ('{"name": "f", "parameters": {}} and some text', " and some text", [("f", "{}")]),
    ('Hello {"name": "f", "parameters": {}}', 'Hello {"name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": {"a": 1}; {"name": "g"', '{"name": "f", "parameters": {"a": 1}; {"name": "g"', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {}}; oops', "; oops", [("f", "{}")]),
    ("<|python_ta", "<|python_ta", []),
    ("plain answer", "plain answer", []),
]

REQUIRED = [
    ('[{"name": "f", "parameters": {"a": 1}}]', None, [("f", '{"a": 1}')]),
    ('[ {"name": "f", "parameters": {}} , {"name": "g", "parameters": {"b": "]"}} ]', None,
     [("f", "{}"), ("g", '{"b": "]"}')]),
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param', ', {"name": "g", "param', [("f", '{"a": 1}')]),
    ("not json", "not json", []),
]


def _splits(n: int):
    yield ()
    for i in range(1, n):
        yield (i,)
    for i in range(1, n):
        for j in range(i + 1, n):
            yield (i, j)


def _streamed(make, text: str, cuts: tuple[int, ...]):
    stream = make()
    bounds = [0, *cuts, len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    calls = [c for d in deltas for c in d.calls]
    return content or None, calls


def _check_shape(deltas) -> None:
    """Each call's first delta has index, id, type, name and empty arguments; the others only arguments."""
    seen = set()
    for d in deltas:
        shape = d.model_dump()
        if d.index not in seen:
            seen.add(d.index)
            assert set(shape) == {"index", "id", "type", "function"} and shape["type"] == "function"
            assert shape["id"].startswith("call_") and shape["function"]["arguments"] == ""
            assert set(shape["function"]) == {"name", "arguments"}
        else:
            assert shape == {"index": d.index, "function": {"arguments": d.function.arguments}}
    assert sorted(seen) == list(range(len(seen)))


def _check(make, text, content, calls):
    whole = extract(make(), text)
    assert whole.content == content
    assert [(c.function.name, c.function.arguments) for c in whole.calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.calls)
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)
    cut_limit = 2 if len(text) <= 80 else 1  # two-cut splits of long strings add nothing but time
    for cuts in _splits(len(text)):
        if len(cuts) > cut_limit:
            continue
        streamed_content, deltas = _streamed(make, text, cuts)
        assert streamed_content == content, cuts
        assert [(c.function.name, c.function.arguments) for c in assemble(deltas)] == calls, cuts
        _check_shape(deltas)


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes(text, content, calls):
    _check(HermesToolStream, text, content, calls)


@pytest.mark.parametrize("text,content,calls", LLAMA3)
def test_llama3_json(text, content, calls):
    _check(Llama3JsonToolStream, text, content, calls)


@pytest.mark.parametrize("text,content,calls", REQUIRED)
def test_required(text, content, calls):
    _check(RequiredToolStream, text, content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f'<tool_call>{WEATHER}</tool_call><tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>'
    _check(lambda: HermesToolStream(parallel=False), text, None, [("get_weather", WEATHER_ARGS)])
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]'
    _check(lambda: RequiredToolStream(parallel=False), text, None, [("f", "{}")])


def test_named_streams_the_output_as_the_arguments():
    text = '{"city": "Paris", "days": [1, 2]}'
    _check(lambda: NamedToolStream("get_weather"), text, None, [("get_weather", text)])
    stream = NamedToolStream("f")
    first, second = stream.feed('{"a"'), stream.feed(": 1}")
    assert [d.model_dump() for d in second.calls] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert first.calls[0].function.name == "f" and first.calls[1].function.arguments == '{"a"'


def test_required_schema_names_each_tool_with_its_parameters():
    tools = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
             for n, p in [("f", {"type": "object", "properties": {"a": {"type": "integer"}}}), ("g", None)]]
    schema = required_schema(tools, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    f, g = schema["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert f["properties"]["parameters"] == tools[0].function.parameters
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert required_schema(tools[:1], parallel=False)["maxItems"] == 1


def test_registry_has_vllms_names():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
                                 "granite", "internlm", "jamba", "kimi_k2", "mistral", "openai", "pythonic",
                                 "qwen3_coder"}
    from pressroom.entrypoints.cli import TOOL_CALL_PARSERS
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)  # the CLI's choices, kept apart for start-up time
