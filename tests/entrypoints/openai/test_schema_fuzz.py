"""Schema fuzzing (issues 13 and 41): schemathesis generates requests from /openapi.json (bodies included:
the document declares them), valid and invalid, against a real `pressroom serve` with an API key; not one
may get a 5xx. Bounded: 50 examples per operation and mode, a 64-token context; about a minute on 2 cores.

And the integers at the edges (issue 41): every integer field of every request body the document declares, however
deep (token ids in a prompt, a message's fields, a nested option), is sent 2^63, 2^64, -2^63-1 and 2^70 in an
otherwise valid body, one field at a time; each answer must be below 500 (a 400 naming the field, or a 200 where
the value is in range: a seed takes 64 unsigned bits).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

KEY = "sesame"  # conftest.py's TINY_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_OPERATION = 50
# Routes that translate into the chat handler's request (whose own route takes the full 50) fuzz their own
# bodies with fewer: the suite's time budget.
EXAMPLES_ON_THE_CHAT_PATH = {"/v1/responses": 20, "/v1/responses/{response_id}": 20, "/v1/messages": 20,
                             "/v1/messages/count_tokens": 20, "/v1/chat/completions/batch": 20,
                             "/generative_scoring": 20}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(keyed_tiny_server):
    # the tiny llama behind KEY with a 64-token context, which bounds what any fuzzed max_tokens x n can cost
    # (shared: conftest.py)
    return keyed_tiny_server


@pytest.fixture(scope="module")
def pooling_server(minilm_server):
    """The pooling routes are fuzzed on a model that pools (the real MiniLM, no API key: the key's header is
    sent and ignored), so valid bodies reach the engine (shared: conftest.py)."""
    return minilm_server


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json", headers=AUTH)


@pytest.fixture(scope="module")
def pooling_schema(pooling_server):
    return schemathesis.openapi.from_url(f"{pooling_server}/openapi.json", headers=AUTH)


# Parametrized here rather than by schemathesis' lazy `from_fixture`, which pytest 9 breaks (it reads a private
# attribute of pytest's nodes); test_every_operation_is_fuzzed keeps the list whole.
GETS = ["/health", "/ping", "/load", "/version", "/metrics", "/v1/models", "/v1/responses/{response_id}",
        "/kv_event_sources"]
POSTS = ["/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
         "/v1/messages/count_tokens", "/generative_scoring"]
# bodies of two short strings, which schemathesis cannot make invalid ("negative" is unsatisfiable for them)
POSITIVE_POSTS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
POOLING_POSTS = ["/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                 "/classify", "/v2/embed"]
# a JSON object of any fields: /invocations dispatches on them, the others check them by hand (as vLLM's do)
ANY_OBJECT_POSTS = ["/invocations", "/v1/chat/completions/batch", "/scale_elastic_ep"]
FORM_POSTS = ["/v1/audio/transcriptions", "/v1/audio/translations"]  # multipart forms (the text model: 400s)
CASES = ([("GET", path, "positive") for path in GETS]
         + [("POST", path, mode) for path in POSTS + POOLING_POSTS + FORM_POSTS for mode in ("positive", "negative")]
         + [("POST", path, "positive") for path in POSITIVE_POSTS + ANY_OBJECT_POSTS])


@pytest.mark.parametrize("method,path,mode", CASES)
def test_no_request_gets_a_5xx(request, method, path, mode):
    schema = request.getfixturevalue("pooling_schema" if path in POOLING_POSTS else "api_schema")
    operation = schema[path][method]

    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=EXAMPLES_ON_THE_CHAT_PATH.get(path, EXAMPLES_PER_OPERATION), deadline=None,
              suppress_health_check=list(HealthCheck), database=None)
    def check(case) -> None:
        response = case.call(headers=AUTH, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:  # every error is OpenAI-shaped JSON (Anthropic's for /v1/messages: alike)
            assert response.json()["error"]["message"], response.text[:500]

    check()


def test_every_operation_is_fuzzed(server):
    document = httpx.get(f"{server}/openapi.json", headers=AUTH).json()
    declared = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert declared == {(method, path) for method, path, _ in CASES}
    for path in POSTS + POSITIVE_POSTS + POOLING_POSTS:  # and their bodies are declared, so bodies are fuzzed
        assert document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


# ---- integers at the edges ----

EDGES = [1 << 63, 1 << 64, -(1 << 63) - 1, 1 << 70]
MESSAGES = [{"role": "user", "content": "hi"}]
VALID_BODIES = {  # per route: a valid body, which each case changes in one integer field
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2]},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": MESSAGES},
    "/generative_scoring": {"model": "tiny", "query": "hi", "items": ["a"], "label_token_ids": [1]},
    "/v1/embeddings": {"model": "minilm", "input": "hi"},
    "/pooling": {"model": "minilm", "input": "hi"},
    "/score": {"model": "minilm", "text_1": "a", "text_2": "b"},
    "/v1/score": {"model": "minilm", "text_1": "a", "text_2": "b"},
    "/rerank": {"model": "minilm", "query": "a", "documents": ["b"]},
    "/v1/rerank": {"model": "minilm", "query": "a", "documents": ["b"]},
    "/v2/rerank": {"model": "minilm", "query": "a", "documents": ["b"]},
    "/classify": {"model": "minilm", "input": "hi"},
    "/v2/embed": {"model": "minilm", "texts": ["hi"]},
}
FieldPath = tuple[str | int, ...]  # keys and list positions from the body's root


def _resolve(document: dict, ref: str) -> dict:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def integer_fields(schema: dict, document: dict, path: FieldPath = (),
                   refs: frozenset[str] = frozenset()) -> Iterator[FieldPath]:
    """The path of every integer in a JSON schema, through $refs (each once per path: models may nest
    themselves), unions, objects, arrays and maps."""
    if "$ref" in schema:
        if schema["$ref"] not in refs:
            yield from integer_fields(_resolve(document, schema["$ref"]), document, path, refs | {schema["$ref"]})
        return
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []):
            yield from integer_fields(branch, document, path, refs)
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        yield path
    for name, sub in schema.get("properties", {}).items():
        yield from integer_fields(sub, document, (*path, name), refs)
    if isinstance(schema.get("items"), dict):
        yield from integer_fields(schema["items"], document, (*path, 0), refs)
    for i, sub in enumerate(schema.get("prefixItems", [])):
        yield from integer_fields(sub, document, (*path, i), refs)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from integer_fields(schema["additionalProperties"], document, (*path, "key"), refs)


def put(node: Any, path: FieldPath, value: int) -> Any:
    """`node` with `value` at `path`, the objects and lists on the way made (or the first element taken) as
    needed; `node` itself unchanged."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        items = list(node) if isinstance(node, list) and node else [None]
        items[0] = put(items[0], rest, value)
        return items
    fields = dict(node) if isinstance(node, dict) else {}
    fields[key] = put(fields.get(key), rest, value)
    return fields


def test_the_walk_finds_nested_integers():
    document = {"components": {"schemas": {"M": {"properties": {"a": {"type": "integer"},
                                                                 "self": {"$ref": "#/components/schemas/M"}}}}}}
    schema = {"properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                             "ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                               {"type": "array", "items": {"type": "array",
                                                                            "items": {"type": "integer"}}}]},
                             "m": {"$ref": "#/components/schemas/M"},
                             "map": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    found = set(integer_fields(schema, document))
    # M's own field, not again through its reference to itself
    assert found == {("n",), ("ids", 0), ("ids", 0, 0), ("m", "a"), ("map", "key")}
    assert put({"ids": "x", "m": {"b": 1}}, ("m", "self", "a"), 7) == {"ids": "x", "m": {"b": 1, "self": {"a": 7}}}
    assert put({"messages": [{"role": "user"}]}, ("messages", 0, "n"), 7) == {"messages": [{"role": "user", "n": 7}]}


@pytest.mark.parametrize("path", POSTS + POOLING_POSTS)
def test_every_integer_field_at_the_edges_gets_no_5xx(request, path):
    url = request.getfixturevalue("pooling_server" if path in POOLING_POSTS else "server")
    document = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    body_schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = sorted(set(integer_fields(body_schema, document)), key=str)
    if path in ("/v1/completions", "/v1/chat/completions"):
        assert {("n",), ("seed",), ("max_tokens",), ("priority",), ("top_k",)} <= set(fields), fields
    failures = []
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        for field in fields:
            for value in EDGES:
                body = put(VALID_BODIES[path], field, value)
                r = http.post(path, json=body)
                if r.status_code >= 500 or (r.status_code >= 400 and not r.json().get("error", {}).get("message")):
                    failures.append((field, value, r.status_code, r.text[:300]))
    print(f"{path}: {len(fields)} integer fields x {len(EDGES)} edges")
    assert not failures, failures
