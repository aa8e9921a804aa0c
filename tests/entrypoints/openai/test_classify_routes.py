"""The pooling routes vLLM 0.32 serves beyond OpenAI's: /classify (a classifier's probabilities, as vLLM's), /score
and /rerank on a cross-encoder (each pair read as one prompt), Cohere's /v2/embed (its embedding types) and
/v2/rerank. Oracles: HF transformers' logits on the same tiny random BERT classifiers, and the MiniLM server's own
/v1/embeddings and /rerank."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from classifier_checkpoint import DOCS, LABELS, QUERY, TEXTS, hf_logits, write_classifier, write_labelled_classifier

MODEL = "minilm"


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


# ---- on the shared MiniLM server (an embedding model) ----

def test_cohere_v2_embed_gives_each_embedding_type(minilm_server):
    texts = TEXTS[:2]
    floats = [d["embedding"] for d in _post(minilm_server, "/v1/embeddings", {"input": texts}).json()["data"]]
    r = _post(minilm_server, "/v2/embed", {"model": MODEL, "texts": texts,
                                           "embedding_types": ["float", "binary", "ubinary", "base64"]})
    assert r.status_code == 200, r.text
    body = r.json()
    emb = body["embeddings"]
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == texts
    assert body["meta"]["api_version"]["version"] == "2" and body["meta"]["billed_units"]["input_tokens"] > 0
    np.testing.assert_allclose(emb["float"], floats, atol=1e-6)
    bits = np.packbits(np.asarray(floats) >= 0, axis=-1)
    assert emb["ubinary"] == bits.tolist() and emb["binary"] == (bits.astype(int) - 128).tolist()
    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in emb["base64"]]
    np.testing.assert_allclose(decoded, floats, atol=1e-6)
    # default type float; inputs' text parts; output_dimension keeps the first n, renormalised
    short = _post(minilm_server, "/v2/embed", {"inputs": [{"content": [{"type": "text", "text": texts[0]}]}],
                                               "output_dimension": 8}).json()["embeddings"]
    assert short["binary"] is None and short["base64"] is None
    head = np.asarray(floats[0][:8])
    np.testing.assert_allclose(short["float"][0], head / np.linalg.norm(head), atol=1e-5)


def test_cohere_truncation(minilm_server):
    long_text = " ".join(["word"] * 40)
    none = _post(minilm_server, "/v2/embed", {"texts": [long_text], "truncate": "NONE", "max_tokens": 8})
    assert none.status_code == 400 and "truncate=NONE" in none.json()["error"]["message"]
    end = _post(minilm_server, "/v2/embed", {"texts": [long_text], "truncate": "END", "max_tokens": 8}).json()
    assert end["meta"]["billed_units"]["input_tokens"] == 8
    cut = _post(minilm_server, "/v1/embeddings", {"input": " ".join(["word"] * 6)}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(end["embeddings"]["float"][0], cut, atol=1e-5)  # [CLS] 6 words [SEP]


def test_cohere_refusals_and_classify_on_an_embedding_model(minilm_server):
    for body, words in [({"texts": ["a"], "input_type": "search_query"}, "input_type"),
                        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
                        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "b"}]}]}, "Exactly one"),
                        ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url")]:
        r = _post(minilm_server, "/v2/embed", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = _post(minilm_server, "/classify", {"model": MODEL, "input": "hello"})
    assert r.status_code == 400 and "does not support classification" in r.json()["error"]["message"]


def test_use_activation_is_vllms_name_for_normalize(minilm_server):
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        unit, raw = (_post(minilm_server, path, {"input": QUERY, "use_activation": a}).json()["data"][0][key]
                     for a in (True, False))
        assert np.linalg.norm(unit) == pytest.approx(1.0, abs=1e-5) and np.linalg.norm(raw) > 1.5
        np.testing.assert_allclose(np.asarray(raw) / np.linalg.norm(raw), unit, atol=1e-5)


def test_v2_rerank_is_rerank(minilm_server):
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    v1, v2 = _post(minilm_server, "/rerank", body).json(), _post(minilm_server, "/v2/rerank", body).json()
    assert [r["index"] for r in v2["results"]] == [r["index"] for r in v1["results"]]
    assert [r["relevance_score"] for r in v2["results"]] == pytest.approx([r["relevance_score"] for r in v1["results"]])


# ---- servers of tiny classifiers ----

@pytest.mark.slow  # two servers of their own (some 10 s each on two cores)
def test_classify_and_cross_encoder_routes_against_hf(tmp_path_factory):
    from conftest import tiny_args
    from serving import serve
    classifier = write_labelled_classifier(tmp_path_factory.mktemp("cls"))
    cross = write_classifier(tmp_path_factory.mktemp("ce"), 1)
    expected = hf_logits(classifier, TEXTS)
    with serve(tiny_args(classifier, name="cls"), tmp_path_factory.mktemp("cls-log") / "server.log") as (url, _):
        r = _post(url, "/classify", {"model": "cls", "input": TEXTS})
        logits = _post(url, "/classify", {"input": TEXTS[0], "use_activation": False}).json()
        embed = _post(url, "/v1/embeddings", {"input": "hi"})
        chat_form = _post(url, "/classify", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify") and body["usage"]["prompt_tokens"] > 0
    probs = torch.tensor([d["probs"] for d in body["data"]])
    torch.testing.assert_close(probs, expected.softmax(-1), atol=1e-5, rtol=0)
    assert [d["label"] for d in body["data"]] == [LABELS[int(i)] for i in expected.argmax(-1)]
    assert [d["num_classes"] for d in body["data"]] == [3, 3, 3]
    torch.testing.assert_close(torch.tensor(logits["data"][0]["probs"]), expected[0], atol=1e-4, rtol=0)
    assert embed.status_code == 400 and "classifier" in embed.json()["error"]["message"]
    assert chat_form.status_code == 400 and "messages" in chat_form.json()["error"]["message"]

    scores = hf_logits(cross, [QUERY] * len(DOCS), DOCS)[:, 0].sigmoid()
    with serve(tiny_args(cross, name="ce"), tmp_path_factory.mktemp("ce-log") / "server.log") as (url, _):
        score = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
        rerank = _post(url, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in score["data"]]), scores, atol=1e-5, rtol=0)
    assert [x["index"] for x in rerank["results"]] == scores.argsort(descending=True)[:2].tolist()
    assert rerank["results"][0]["relevance_score"] == pytest.approx(float(scores.max()), abs=1e-5)
