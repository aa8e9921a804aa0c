"""LLM.classify and LLM.score as vLLM's, on the pooling runner: tiny random BERT classifiers (three labels, and a
one-label cross-encoder) against HF transformers' logits on the same weights, and the real all-MiniLM-L6-v2 as a
bi-encoder against HF's mean-pooled cosine."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from classifier_checkpoint import (
    DOCS,
    LABELS,
    QUERY,
    TEXTS,
    hf_logits,
    minilm_path,
    write_classifier,
    write_labelled_classifier,
)

from pressroom import LLM, PoolingParams
from pressroom.engine.classify import ClassifierHead, check_pair_segments, pair_up


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    return write_labelled_classifier(tmp_path_factory.mktemp("bert-cls"))


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> str:
    return write_classifier(tmp_path_factory.mktemp("bert-ce"), 1)


def test_classify_gives_hfs_softmax_and_labels(classifier_dir):
    expected = hf_logits(classifier_dir, TEXTS)
    with LLM(classifier_dir, dtype="float32", device="cpu") as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
        logits = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        ids = llm.get_tokenizer()(TEXTS[0])["input_ids"]
        encoded = llm.encode(TEXTS, pooling_task="classify", use_tqdm=False)
        with pytest.raises(ValueError, match="token_embed"):
            llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
        with pytest.raises(ValueError, match="classifier"):
            llm.embed(TEXTS[0], use_tqdm=False)
        with pytest.raises(ValueError, match="num_labels == 1"):
            llm.score(QUERY, DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="lora_request"):
            llm.classify(TEXTS, lora_request=object(), use_tqdm=False)
        with pytest.raises(ValueError, match="do not apply"):
            llm.classify(TEXTS, pooling_params=PoolingParams(dimensions=2), use_tqdm=False)
        head = ClassifierHead.of(llm.engine.hf_config)
    assert [o.outputs.num_classes for o in outs] == [3, 3, 3]
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), expected.softmax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in logits]), expected, atol=1e-4, rtol=0)
    assert outs[0].prompt_token_ids == ids and outs[0].finished
    assert [e.outputs.data for e in encoded] == [o.outputs.probs for o in outs]  # vLLM's encode(pooling_task=...)
    assert head.label(outs[1].outputs.probs) == LABELS[int(expected[1].argmax())]


def test_cross_encoder_scores_pairs_with_their_segments(cross_encoder_dir):
    one_to_n = hf_logits(cross_encoder_dir, [QUERY] * len(DOCS), DOCS)[:, 0].sigmoid()
    pairwise = hf_logits(cross_encoder_dir, TEXTS, DOCS)[:, 0].sigmoid()
    with LLM(cross_encoder_dir, dtype="float32", device="cpu") as llm:
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        pairs = llm.score(TEXTS, DOCS, use_tqdm=False)
        raw = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        pair_ids = llm.get_tokenizer()(QUERY, DOCS[0])["input_ids"]
        with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
            llm.score(TEXTS[:2], DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="chat_template"):
            llm.score(QUERY, DOCS, chat_template="{{ x }}", use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), one_to_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in pairs]), pairwise, atol=1e-5, rtol=0)
    assert scores[0].prompt_token_ids == pair_ids  # the pair as one prompt: [CLS] query [SEP] doc [SEP]
    assert raw[0].outputs.score == pytest.approx(math.log(one_to_n[0] / (1 - one_to_n[0])), abs=1e-4)


def test_bi_encoder_scores_cosine_of_embeddings():
    import transformers
    path = minilm_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        batch = tokenizer([QUERY, *DOCS], padding=True, return_tensors="pt")
        states = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1)
        mean = (states * mask).sum(1) / mask.sum(1)  # all-MiniLM-L6-v2's pooling
    expected = torch.nn.functional.cosine_similarity(mean[:1], mean[1:])
    with LLM(path, dtype="float32", device="cpu") as llm:
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        query_ids = llm.get_tokenizer()(QUERY)["input_ids"]
        unit, raw = (llm.embed(QUERY, PoolingParams(use_activation=a), use_tqdm=False)[0].outputs.embedding
                     for a in (None, False))
        with pytest.raises(ValueError, match="classification model"):
            llm.classify(QUERY, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected, atol=1e-5, rtol=0)
    assert scores[0].prompt_token_ids[:len(query_ids)] == query_ids
    # use_activation, vLLM 0.32's name for an embedding's normalisation: False leaves the mean as it is
    torch.testing.assert_close(torch.tensor(raw), mean[0], atol=1e-5, rtol=0)
    assert torch.tensor(unit).norm() == pytest.approx(1.0, abs=1e-5) and torch.tensor(raw).norm() > 1.5


def test_pairing_activations_and_segment_check():
    assert pair_up(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="empty"):
        pair_up([], ["a"])
    config = SimpleNamespace(architectures=["BertForSequenceClassification"], num_labels=1, type_vocab_size=2,
                             sep_token_id=None, id2label={0: "LABEL_0"})
    with pytest.raises(ValueError, match="sep_token_id"):
        check_pair_segments(config)
    head = ClassifierHead.of(config)
    assert head.is_cross_encoder and head.activation == "sigmoid" and head.probs([0.0]) == [0.5]
    regression = ClassifierHead.of(SimpleNamespace(**{**vars(config), "problem_type": "regression"}))
    assert regression.probs([2.5]) == [2.5]
    st = SimpleNamespace(**{**vars(config), "num_labels": 2,
                            "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}})
    assert ClassifierHead.of(st).activation == "identity"
    assert ClassifierHead.of(SimpleNamespace(architectures=["BertModel"])) is None
