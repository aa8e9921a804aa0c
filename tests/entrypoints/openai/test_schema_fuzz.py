"""Schema fuzzing (issue 13, item 6): schemathesis generates requests from /openapi.json (bodies included:
the document declares them), valid and invalid, against a real `pressroom serve` with an API key; not one
may get a 5xx. Bounded: 50 examples per operation and mode, a 64-token context; about a minute on 2 cores.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

KEY = "sesame"  # conftest.py's TINY_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_OPERATION = 50

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
GETS = ["/health", "/version", "/metrics", "/v1/models"]
POSTS = ["/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"]
POOLING_POSTS = ["/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank"]
CASES = [("GET", path, "positive") for path in GETS] + [("POST", path, mode) for path in POSTS + POOLING_POSTS
                                                         for mode in ("positive", "negative")]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_no_request_gets_a_5xx(request, method, path, mode):
    schema = request.getfixturevalue("pooling_schema" if path in POOLING_POSTS else "api_schema")
    operation = schema[path][method]

    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def check(case) -> None:
        response = case.call(headers=AUTH, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:  # every error is OpenAI-shaped JSON
            assert response.json()["error"]["message"], response.text[:500]

    check()


def test_every_operation_is_fuzzed(server):
    document = httpx.get(f"{server}/openapi.json", headers=AUTH).json()
    declared = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert declared == {(method, path) for method, path, _ in CASES}
    for path in POSTS + POOLING_POSTS:  # and their bodies are declared, so bodies are fuzzed
        assert document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
