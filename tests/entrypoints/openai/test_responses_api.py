"""/v1/responses (OpenAI's Responses API, as vLLM 0.32 serves it) through the official openai client's
`client.responses`, against the shared server of the embedded SmolLM2 (hermes tool parser; conftest.py).

A Responses request is the chat request it becomes, so at temperature 0 its text and token counts are the chat
completion's; streamed, its events come in the API's order and add up to the whole response; previous_response_id
puts the earlier turns before the new input. Reasoning needs a reasoning model: the stream's reasoning item is
checked on the event writer directly, and end to end (a server of its own) under `slow`.
"""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from pressroom.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from pressroom.entrypoints.openai.protocol_responses import ResponseObject
from pressroom.entrypoints.openai.serving_responses import (
    MAX_STORED_RESPONSES,
    ResponseStore,
    StoredResponse,
    _Events,
)

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def _warm(client, messages: list[dict]) -> None:
    """One token of the same prompt first: the compared requests then both find it in the prefix cache (a fresh
    prompt's first greedy run can differ from later ones in the last digits, and so in its tokens)."""
    _chat(client, messages, 1)


def test_whole_response_is_the_chat_completions(client):
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "Name a colour of the sky."}]
    _warm(client, messages)
    chat = _chat(client, messages, 8)
    r = client.responses.create(model=MODEL, instructions=messages[0]["content"], input=messages[1]["content"],
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == messages[0]["content"] and r.max_output_tokens == 8


def test_input_items_are_the_chat_messages(client):
    """A list of input messages with input_text parts, a developer message read as the system's."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]
    _warm(client, messages)
    chat = _chat(client, messages, 6)
    r = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there."}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_in_order_add_up_to_the_whole(client):
    kwargs = dict(model=MODEL, input="Write a word about the sea.", max_output_tokens=6, temperature=0)
    _warm(client, [{"role": "user", "content": kwargs["input"]}])
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                     *["response.output_text.delta"] * len(deltas), *TEXT_EVENTS[2:], "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-2].item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 6
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada.",
                                    max_output_tokens=5, temperature=0)
    # the previous turn's input and output, then the new input; the new request's own instructions (none here)
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    _warm(client, conversation)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    chat = _chat(client, conversation, 5)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + 5
    assert second.output_text == chat.choices[0].message.content
    kept = client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text and kept.usage == first.usage


def test_unknown_or_unstored_response_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "resp_unknown" in e.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": []}, "input.list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.list.0.message.content.list.0.type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),  # no tools to call: the chat's own rule
    ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),  # past the context: named as sent
], ids=["max_output_tokens", "temperature", "empty-input", "image", "built-in-tool", "background", "choice",
        "too-many-tokens"])
def test_bad_fields_are_400s_naming_them(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_function_call_and_its_output(client):
    """A named function's call (constrained to its JSON), then its output given back after it: the answer's
    prompt holds the call and the output."""
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32,
                                    temperature=0)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert [item.type for item in asked.output] == ["function_call"] and asked.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}], max_output_tokens=4, temperature=0)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > asked.usage.input_tokens + 4  # the question, the call, and its output
    streamed = list(client.responses.create(
        stream=True, model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32, temperature=0))
    kinds = [e.type for e in streamed]
    fragments = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(fragments),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = streamed[-2].item
    assert done.name == "get_weather" and done.arguments == "".join(fragments) == streamed[-3].arguments
    assert json.loads(done.arguments) == json.loads(call.arguments)


def test_a_dropped_stream_ends_its_request(server):
    """A client gone mid-stream aborts its request at once (its 2,000 tokens would take the server a minute)."""
    body = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=30) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 2:
                assert _running(server) == 1
                break
    deadline = time.monotonic() + 5
    while _running(server):
        assert time.monotonic() < deadline, "the dropped stream's request still runs"
        time.sleep(0.1)


def _running(server: str) -> float:
    values = re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", httpx.get(f"{server}/metrics").text,
                        re.M)
    assert values, "no num_requests_running gauge"
    return sum(map(float, values))


# ---- the event writer and the store, without a server ----

def test_events_of_reasoning_then_text_then_a_call():
    """The stream's items in output order: reasoning, message, function call, each done when the next opens."""
    response = ResponseObject(id="resp_x", model=MODEL)
    events = _Events(response)
    sent = events.text("reasoning", "think") + events.text("reasoning", "ing") + events.text("message", "Hi")
    sent += events.call(DeltaToolCall(index=0, id="call_1", type="function",
                                      function=DeltaFunctionCall(name="f", arguments="")))
    sent += events.call(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}')))
    sent += events.finish("completed")
    data = [json.loads(e.split("data: ", 1)[1]) for e in sent]
    assert [d["type"] for d in data] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", *TEXT_EVENTS[:2], "response.output_text.delta", *TEXT_EVENTS[2:],
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["output_index"] for d in data if d["type"] == "response.output_item.done"] == [0, 1, 2]
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "thinking" and response.output[1].content[0].text == "Hi"
    assert response.output[2].arguments == '{"a": 1}' and response.output[2].call_id == "call_1"
    assert all(item.status == "completed" for item in response.output)


def test_an_output_with_nothing_to_say_still_has_its_message():
    response = ResponseObject(id="resp_x", model=MODEL)
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in _Events(response).finish("incomplete")]
    assert kinds == TEXT_EVENTS and response.output[0].status == "incomplete"
    assert response.output[0].content[0].text == ""


def test_the_store_drops_the_oldest_past_its_capacity():
    assert MAX_STORED_RESPONSES >= 100
    store = ResponseStore(capacity=2)
    for rid in ("resp_a", "resp_b", "resp_c"):
        store.put(StoredResponse(ResponseObject(id=rid, model=MODEL), []))
    assert store.get("resp_a") is None and store.get("resp_b") and store.get("resp_c")


# ---- reasoning end to end ----

@pytest.mark.slow  # a server of the tiny think model of its own (~8 s)
def test_reasoning_item_whole_and_streamed(think_model_dir, tmp_path):
    import transformers
    from conftest import tiny_args
    from serving import serve
    tok = transformers.AutoTokenizer.from_pretrained(think_model_dir)
    end, sky = tok.convert_tokens_to_ids("</think>"), tok.encode(" sky", add_special_tokens=False)[0]
    with serve(tiny_args(think_model_dir, name="think"), tmp_path / "server.log", shutdown_s=20) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        # four thoughts, the end marker, then three words of answer
        body = dict(model="think", input="Why?", max_output_tokens=8, temperature=0,
                    extra_body={"thinking_token_budget": 4, "ignore_eos": True,
                                "logit_bias": {str(sky): 100.0, str(end): -100.0}})
        whole = client.responses.create(**body)
        chat = client.chat.completions.create(model="think", messages=[{"role": "user", "content": "Why?"}],
                                              max_tokens=8, temperature=0, **{"extra_body": body["extra_body"]})
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == chat.choices[0].message.reasoning
        assert whole.output_text == chat.choices[0].message.content and whole.output_text
        assert whole.usage.output_tokens_details.reasoning_tokens == 5
        streamed = list(client.responses.create(stream=True, **body))
        reasoning = "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta")
        assert reasoning == whole.output[0].content[0].text
        assert streamed[-1].response.output_text == whole.output_text
        assert [e.type for e in streamed if e.type == "response.output_item.added"] == [
            "response.output_item.added"] * 2
