"""Tool calling through `pressroom serve` with the official openai client (issue 17, item 2).

The server runs the embedded SmolLM2 with `--enable-auto-tool-choice --tool-call-parser hermes`. Its own chat
template ignores `tools` and renders no assistant `tool_calls` (it writes only each message's content), so the
round trip sends a hermes-style template with the request (`--trust-request-chat-template`): the tools, the
call and the tool's result are then all in the prompt. The 135M model seldom calls a tool on its own, so calls
come from tool_choice "required" or a named function (structured outputs constrain them to JSON), and the
answer after the tool's result from tool_choice "none". Greedy decoding makes streamed and whole outputs equal.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions. To call one, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
<tools>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for call in m.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEMPLATE = {"chat_template": HERMES_TEMPLATE}


@pytest.fixture(scope="module")
def server(smol_server):
    """The embedded model with the hermes parser and request templates on (shared: conftest.py)."""
    return smol_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages, stream: bool, max_tokens: int = 48, **kwargs) -> dict:
    """One greedy chat completion as {content, calls: [(id, name, arguments)], finish}; streamed ones
    reassembled from their deltas as a client does."""
    body = dict(model="smol", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=TEMPLATE) | kwargs
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason}
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return {"content": "".join(content) or None, "calls": [tuple(calls[i]) for i in sorted(calls)], "finish": finish}


def _valid_call(name: str, arguments: str) -> bool:
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    args = json.loads(arguments)
    schema = tool["function"]["parameters"]
    return set(schema["required"]) <= set(args) and all(isinstance(v, str) for v in args.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_round_trip(client, stream):
    """A named call, the tool's result back through the template, then an answer without tools."""
    asked = _chat(client, ASK, stream, tools=TOOLS, tool_choice=NAMED)
    assert asked["finish"] == "tool_calls" and asked["content"] is None and len(asked["calls"]) == 1
    call_id, name, arguments = asked["calls"][0]
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    conversation = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    answer = _chat(client, conversation, stream, max_tokens=24, tools=TOOLS, tool_choice="none")
    assert answer["calls"] == [] and answer["content"] and answer["finish"] in ("stop", "length")


def test_streamed_calls_reassemble_to_the_whole_calls(client):
    # one call: with parallel calls allowed the small model goes on listing calls until max_tokens
    for choice in ("required", NAMED):
        whole = _chat(client, ASK, False, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        streamed = _chat(client, ASK, True, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert [c[1:] for c in streamed["calls"]] == [c[1:] for c in whole["calls"]] and whole["calls"]
        assert streamed["finish"] == whole["finish"] == "tool_calls"
        assert streamed["content"] == whole["content"]


@pytest.mark.parametrize("question", [
    "What is the weather in Paris right now?",
    "What time is it in Tokyo?",
    "Tell me a joke about penguins.",
])
def test_required_always_yields_a_valid_call(client, question):
    out = _chat(client, [{"role": "user", "content": question}], False, max_tokens=64, tools=TOOLS,
                tool_choice="required", parallel_tool_calls=False)
    assert out["finish"] == "tool_calls" and len(out["calls"]) == 1, out
    assert _valid_call(*out["calls"][0][1:]), out


def test_streamed_tool_call_deltas_are_openais_shape(server):
    """The raw SSE: a call's first delta carries index, id, type and name with empty arguments; the others
    only index and an arguments fragment; no nulls inside them."""
    body = {"model": "smol", "messages": ASK, "max_tokens": 48, "temperature": 0, "stream": True,
            "tools": TOOLS, "tool_choice": NAMED}
    deltas = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas += json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []
    head, *rest = deltas
    assert set(head) == {"index", "id", "type", "function"} and head["function"]["arguments"] == ""
    assert head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert json.loads("".join(d["function"]["arguments"] for d in rest)) == {"city": "Paris"}


def test_the_template_gets_the_tools_the_calls_and_the_results(server):
    conversation = ASK + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = httpx.post(f"{server}/tokenize", json={"messages": conversation, "tools": TOOLS, **TEMPLATE}).json()["tokens"]
    prompt = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"name": "get_time"' in prompt  # the tools' definitions
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # arguments given as an object
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize("fields,message", [
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among `tools`"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tool_requests_are_400s(server, fields, message):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "smol", "messages": ASK, "max_tokens": 1} | fields)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_auto_reads_calls_with_the_servers_parser(client):
    """tool_choice "auto" (the default with tools) parses the output with --tool-call-parser; a regex
    (structured outputs) makes the model write one hermes call."""
    call = '<tool_call>{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}</tool_call>'
    regex = call.replace("{", r"\{").replace("}", r"\}")
    out = _chat(client, ASK, False, max_tokens=40, tools=TOOLS,
                extra_body=TEMPLATE | {"structured_outputs": {"regex": regex}})
    assert out["content"] is None and out["finish"] == "tool_calls"
    assert [c[1:] for c in out["calls"]] == [("get_time", '{"timezone": "Asia/Tokyo"}')]
