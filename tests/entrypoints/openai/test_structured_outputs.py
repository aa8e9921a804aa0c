"""Structured outputs through `pressroom serve` with the official openai client (issue 17, item 1).

Twenty JSON schemas (nested objects, enums, arrays with length bounds, string patterns, bounded numbers) sent
at once, as `response_format` and as vLLM's `structured_outputs`, whole and streamed, on a server without
and with ngram speculation: every output parses and validates with `jsonschema`. Then regex, choice and
grammar, and the 400s for what cannot be compiled. The embedded SmolLM2 decodes greedily.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from serving import serve

MODEL = "smol"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive_token_budget": False})
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "population": {"type": "integer", "minimum": 1, "maximum": 50000000}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10},
        "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": NAME, "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
        "required": ["name", "pets"]}}, "required": ["person"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer", "minimum": 200,
                                                                            "maximum": 599}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"type": "string", "maxLength": 8}}, "required": ["level", "label"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["id"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 255},
                                              "minItems": 3, "maxItems": 3}}, "required": ["rgb"]},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "middle": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["first", "last", "middle"]},
    {"type": "object", "properties": {"config": {"type": "object", "properties": {
        "debug": {"type": "boolean"}, "retries": {"type": "integer", "minimum": 0, "maximum": 5},
        "mode": {"enum": ["fast", "safe"]}}, "required": ["debug", "retries", "mode"]}}, "required": ["config"]},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{3,6}$"},
                                      "letters": {"type": "integer", "minimum": 3, "maximum": 6}},
     "required": ["word", "letters"]},
]


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server  # the embedded model (shared: conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only, following this schema: {json.dumps(schema)}"}]


async def _chat(client: openai.AsyncOpenAI, schema: dict, i: int, stream: bool) -> str:
    """Schemas with an even index go as response_format, odd ones as structured_outputs."""
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    kwargs = {"response_format": fmt} if i % 2 == 0 else {"extra_body": {"structured_outputs": {"json": schema}}}
    if not stream:
        out = await client.chat.completions.create(model=MODEL, messages=_ask(schema), max_tokens=120,
                                                   temperature=0, **kwargs)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        return out.choices[0].message.content
    chunks = await client.chat.completions.create(model=MODEL, messages=_ask(schema), max_tokens=120,
                                                  temperature=0, stream=True, **kwargs)
    text, reason = "", None
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop", text
    return text


async def _all_schemas(url: str, stream: bool) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(_chat(client, s, i, stream) for i, s in enumerate(SCHEMAS)))


def _assert_valid(texts: list[str]) -> None:
    for schema, text in zip(SCHEMAS, texts):
        jsonschema.validate(json.loads(text), schema)


async def _whole_and_streamed(url: str) -> tuple[list[str], list[str]]:
    return tuple(await asyncio.gather(_all_schemas(url, stream=False), _all_schemas(url, stream=True)))


def test_twenty_schemas_validate_whole_and_streamed(server):
    whole, streamed = asyncio.run(_whole_and_streamed(server))  # 40 requests in one batch
    _assert_valid(whole)
    _assert_valid(streamed)  # (not equal to whole: greedy tokens may differ with the batch around them)


@pytest.mark.slow
def test_twenty_schemas_validate_with_ngram_speculation(tmp_path):
    args = ["serve", "--kv-cache-memory-gib", "0.25", "--served-model-name", MODEL, "--max-num-seqs", "32",
            "--speculative-config", NGRAM]
    with serve(args, tmp_path / "server.log") as (url, _):
        whole, streamed = asyncio.run(_whole_and_streamed(url))
        _assert_valid(whole)
        _assert_valid(streamed)


def test_json_object(client):
    ask = [{"role": "user", "content": 'Return {"ok": true} as JSON.'}]
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"  # the object closed (a cut-off one would not parse)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_choice_and_grammar(client):
    def complete(so: dict, prompt: str = "My phone number is") -> str:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"structured_outputs": so})
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    assert re.fullmatch(r"\d{3}-\d{4}", complete({"regex": r"\d{3}-\d{4}"}))
    assert complete({"choice": ["sunny", "rainy", "cloudy"]}, "The weather today is") in ("sunny", "rainy", "cloudy")
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= "world" | "there"'
    assert re.fullmatch(r"(hello|hi) (world|there)", complete({"grammar": grammar}, "Say hi:"))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                          max_tokens=5, temperature=0,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")


INVALID = [  # (structured_outputs or response_format, words the 400's message must hold)
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "Unsupported type"),
    ({"structured_outputs": {"json": "{not json"}}, "JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "not defined"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "[a-z]{1,30000}"}}}, "repeats too much"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "limit"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"choice": []}}, "non-empty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                       "minimum": 5, "maximum": 1}}}},
     "minimum greater than maximum"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]


@pytest.mark.parametrize("fields,words", INVALID, ids=[w for _, w in INVALID])
def test_what_cannot_be_compiled_is_a_400_naming_the_reason(server, fields, words):
    for path, body in (("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("completions", {"prompt": "hi"})):
        r = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, "max_tokens": 4} | body | fields, timeout=30)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"], r.text


def test_a_schema_with_integers_past_64_bits_is_served(server):
    """The schema crosses to the engine core as text: msgpack cannot carry such numbers (the fuzzer's 500)."""
    r = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": {"enum": [10 ** 30]}}})
    assert r.status_code == 200, r.text


def test_guided_fields_point_to_structured_outputs(server):
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "guided_regex": "a+"})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]
