"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` client, and
vLLM's /reset_prefix_cache (dev mode) and /tokenizer_info (--enable-tokenizer-info-endpoint).

Two servers, neither started for this module alone: the embedded SmolLM2 that several modules share (greedy text
compared with chat completions: a Messages request is run as the chat request it becomes), and the shared tiny
llama's engine served here on loopback by uvicorn in a thread, built with dev mode, the tokenizer-info route, an API
key and a chat template that writes out tools and tool calls (so that what reaches the template can be counted).
The temperature goes in `extra_body`: the client no longer takes it, the API (as vLLM's) still does.
"""
from __future__ import annotations

import json
import os
import re
from unittest import mock

import anthropic
import httpx
import openai
import pytest
from serving import serve_in_thread

from pressroom.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from pressroom.entrypoints.openai.server import DEV_MODE_ENV, build_app
from pressroom.entrypoints.openai.serving_messages import _Blocks
from pressroom.entrypoints.openai.settings import ServerSettings

GREEDY = {"temperature": 0}
SYSTEM = "Answer briefly."
SKY = [{"role": "user", "content": "Reply with one word: what color is the sky?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
KEY = "open-sesame"
# The tiny server's template: every message (a tool result with the call it answers, an assistant's calls), then the
# tools, then the generation prompt.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}{% if m.tool_call_id %} to {{ m.tool_call_id }}{% endif %}>"
            "{{ m.content }}{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}]{% endfor %}"
            "{% endfor %}{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.description }}]"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def smol(smol_server):
    return smol_server  # the embedded SmolLM2 as "smol", hermes tool parser (shared: conftest.py)


@pytest.fixture(scope="module")
def claude(smol):
    with anthropic.Anthropic(base_url=smol, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def sky(claude):
    """The greedy answer to SKY under SYSTEM, whole (several tests compare against it)."""
    return claude.messages.create(model="smol", max_tokens=16, system=SYSTEM, messages=SKY, extra_body=GREEDY)


@pytest.fixture(scope="module")
def tiny(tiny_async_engine):
    """The shared tiny llama's engine served as "tiny" on a loopback port: dev mode, /tokenizer_info, KEY, TEMPLATE."""
    settings = ServerSettings(served_model_name=("tiny",), api_keys=(KEY,), tokenizer_info=True,
                              chat_template=TEMPLATE, log_requests=False, log_stats_interval=0)
    with mock.patch.dict(os.environ, {DEV_MODE_ENV: "1"}):
        app = build_app(tiny_async_engine, settings)
    with serve_in_thread(app) as url:
        yield url


# ---- the embedded SmolLM2 ----

def test_a_message_is_the_chat_completion_of_the_same_conversation(smol, sky):
    chat = openai.OpenAI(base_url=f"{smol}/v1", api_key="unused").chat.completions.create(
        model="smol", max_tokens=16, messages=[{"role": "system", "content": SYSTEM}, *SKY], extra_body=GREEDY)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"  # the answer ends by itself, well within 16 tokens
    assert sky.type == "message" and sky.role == "assistant" and sky.model == "smol" and sky.id.startswith("msg_")
    assert [block.type for block in sky.content] == ["text"]
    assert sky.content[0].text == choice.message.content and sky.content[0].text
    assert (sky.stop_reason, sky.stop_sequence) == ("end_turn", None)
    assert (sky.usage.input_tokens, sky.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)


def test_stop_reasons_max_tokens_and_stop_sequence(claude, sky):
    story = claude.messages.create(model="smol", max_tokens=3, messages=[
        {"role": "user", "content": "Write a long story about a dragon."}], extra_body=GREEDY)
    assert story.stop_reason == "max_tokens" and story.usage.output_tokens == 3 and story.stop_sequence is None
    text = sky.content[0].text
    word = text.split()[-2]  # a word the greedy answer holds: the same request stopping on it ends just before it
    stopped = claude.messages.create(model="smol", max_tokens=16, system=SYSTEM, messages=SKY, stop_sequences=[word],
                                     extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == text[:text.index(word)]


def test_streamed_text_equals_the_whole_message(claude, sky):
    with claude.messages.stream(model="smol", max_tokens=16, system=SYSTEM, messages=SKY, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == sky.content[0].text
    assert final.content[0].text == sky.content[0].text and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (sky.usage.input_tokens, sky.usage.output_tokens)


def test_the_stream_is_anthropics_events(smol):
    body = {"model": "smol", "max_tokens": 2, "messages": SKY, "stream": True}
    response = httpx.post(f"{smol}/v1/messages", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [(m[1], json.loads(m[2])) for m in re.finditer(r"event: (\w+)\ndata: (.*)\n\n", response.text)]
    assert "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events) == response.text
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["usage"] == {"input_tokens": delta["usage"]["input_tokens"], "output_tokens": 0}
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2


def test_a_system_prompt_is_part_of_the_prompt(claude, sky):
    with_system = claude.messages.count_tokens(model="smol", system=SYSTEM, messages=SKY).input_tokens
    as_blocks = claude.messages.count_tokens(model="smol", system=[{"type": "text", "text": SYSTEM}],
                                             messages=SKY).input_tokens
    longer = claude.messages.count_tokens(model="smol", system=SYSTEM + " Use plain words.",
                                          messages=SKY).input_tokens
    without = claude.messages.count_tokens(model="smol", messages=SKY).input_tokens
    assert with_system == as_blocks == sky.usage.input_tokens  # count_tokens counts what /v1/messages runs
    assert longer > with_system and without != with_system  # (SmolLM's template has a system prompt of its own)


def test_a_named_tool_choice_gives_a_tool_use_block(claude):
    request = dict(model="smol", max_tokens=30, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body=GREEDY)
    whole = claude.messages.create(**request)
    assert whole.stop_reason == "tool_use" and [block.type for block in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.name == "get_weather" and isinstance(call.input, dict) and isinstance(call.input["city"], str)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()  # its input put together from input_json_delta events
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == call.input


def test_an_output_format_constrains_the_text(claude):
    schema = {"type": "object", "properties": {"color": {"enum": ["blue", "green"]}}, "required": ["color"]}
    message = claude.messages.create(model="smol", max_tokens=20, messages=SKY, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn" and json.loads(message.content[0].text)["color"] in ("blue", "green")


def test_bad_requests_get_anthropics_errors(smol, claude):
    no_max_tokens = httpx.post(f"{smol}/v1/messages", json={"model": "smol", "messages": SKY})
    assert no_max_tokens.status_code == 400
    error = no_max_tokens.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(model="claude-unknown", max_tokens=2, messages=SKY)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="'image' blocks are not supported"):
        claude.messages.create(model="smol", max_tokens=2, messages=[{"role": "user", "content": [image]}])


def test_the_vllm_dev_and_tokenizer_routes_are_off_by_default(smol):
    assert httpx.post(f"{smol}/reset_prefix_cache").status_code == 404
    assert httpx.get(f"{smol}/tokenizer_info").status_code == 404


def test_stream_blocks_start_and_stop_in_turn():
    """Thinking, then text, then a call: each block starts on its first delta, stops when the next starts, and its
    events carry its index (the reasoning parser's path, which SmolLM2 does not take)."""
    blocks = _Blocks()
    first = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments=""))
    rest = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}'))
    sent = blocks.thinking("Hm") + blocks.thinking(" ok") + blocks.text("") + blocks.text("Hi") + blocks.call(first) \
        + blocks.call(rest) + blocks.stop() + blocks.stop()
    events = [(m[1], json.loads(m[2])) for m in re.finditer(r"event: (\w+)\ndata: (.*)\n\n", "".join(sent))]
    assert [(name, data["index"]) for name, data in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    assert [data["content_block"]["type"] for name, data in events if name == "content_block_start"] == [
        "thinking", "text", "tool_use"]
    assert events[7][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert [data["delta"] for name, data in events if name == "content_block_delta"] == [
        {"type": "thinking_delta", "thinking": "Hm"}, {"type": "thinking_delta", "thinking": " ok"},
        {"type": "text_delta", "text": "Hi"}, {"type": "input_json_delta", "partial_json": '{"a": 1}'}]


# ---- the tiny llama, served here ----

def test_the_key_goes_in_x_api_key_or_as_bearer(tiny):
    with anthropic.Anthropic(base_url=tiny, api_key=KEY, max_retries=0) as client:  # x-api-key, as Anthropic's
        assert client.messages.count_tokens(model="tiny", messages=SKY).input_tokens > 0
    bearer = httpx.post(f"{tiny}/v1/messages/count_tokens", json={"model": "tiny", "messages": SKY},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200
    assert httpx.get(f"{tiny}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    with anthropic.Anthropic(base_url=tiny, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            client.messages.create(model="tiny", max_tokens=2, messages=SKY)
    assert denied.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": denied.value.body["error"]["message"]}}
    assert httpx.get(f"{tiny}/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_tools_and_a_tool_exchange_reach_the_template_as_in_chat(tiny):
    """count_tokens of a conversation with a tool call and its result, and tools, equals /tokenize of the chat
    messages it stands for; the tools' text is in that prompt."""
    auth = {"Authorization": f"Bearer {KEY}"}
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"},
                                     {"type": "text", "text": "Thanks."}]}]
    chat_form = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks."}]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]
    with anthropic.Anthropic(base_url=tiny, api_key=KEY, max_retries=0) as client:
        with_tools = client.messages.count_tokens(model="tiny", messages=conversation, tools=[WEATHER]).input_tokens
        without = client.messages.count_tokens(model="tiny", messages=conversation).input_tokens
    tokenized = httpx.post(f"{tiny}/tokenize", json={"model": "tiny", "messages": chat_form, "tools": chat_tools},
                           headers=auth).json()
    assert with_tools == tokenized["count"] and with_tools > without
    prompt = httpx.post(f"{tiny}/detokenize", json={"model": "tiny", "tokens": tokenized["tokens"]},
                        headers=auth).json()["prompt"]
    assert prompt == ("<user>Weather in Paris?<assistant>Looking.[call call_1 get_weather]<tool to call_1>Sunny"
                      "<user>Thanks.[tool get_weather: The current weather in a city]<assistant>")


def _cached_prompt_tokens(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(m) for m in re.findall(r"^vllm:prompt_tokens_cached_total\{[^}]*\} (\S+)$", metrics, re.M))


def test_reset_prefix_cache_forgets_every_cached_prefix(tiny):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "A prompt of several blocks, said twice to be found cached. " * 3,
            "max_tokens": 1}

    def cached_on_request() -> float:
        before = _cached_prompt_tokens(tiny)
        assert httpx.post(f"{tiny}/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
        return _cached_prompt_tokens(tiny) - before

    cached_on_request()
    assert cached_on_request() >= 32  # its full blocks found in the cache the second time
    assert httpx.post(f"{tiny}/reset_prefix_cache", headers=auth).status_code == 200
    assert cached_on_request() == 0
    assert cached_on_request() >= 32


def test_tokenizer_info(tiny, smollm_tokenizer):
    info = httpx.get(f"{tiny}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["tokenizer_class"] == type(smollm_tokenizer).__name__
    assert (info["bos_token"], info["eos_token"]) == (smollm_tokenizer.bos_token, smollm_tokenizer.eos_token)
    assert isinstance(info["model_max_length"], int) and info["model_max_length"] > 0
    assert info["chat_template"] == TEMPLATE  # the server's, in place of the tokenizer's
    assert not {"name_or_path", "vocab_file", "merges_file", "tokenizer_file"} & set(info)  # no path of the server's
