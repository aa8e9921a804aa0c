"""Classification and scoring on the pooling runner, shared by LLM.classify / LLM.score and the server's /classify,
/score and /rerank, with vLLM's outputs (vllm.outputs' ClassificationRequestOutput, ScoringRequestOutput).

A classifier (an `*ForSequenceClassification` checkpoint) pools its first token's class logits (the model runs
its head on every token: model/models/bert_classifier.py); the activation vLLM applies (its get_act_fn: the
config's problem_type, a sentence-transformers cross-encoder's activation, else sigmoid for one label and softmax
for more) is applied here, on the host. Scores: a cross-encoder (a classifier with one label) reads each text
pair as one prompt; an embedding model embeds both sides and scores their cosine similarity (a bi-encoder).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pressroom.pooling_params import PoolingParams

ACTIVATIONS = ("softmax", "sigmoid", "identity")
# sentence-transformers' CrossEncoder activation names (torch.nn modules, as vLLM restricts them) -> ours
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Softmax": "softmax"}


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # after the activation (use_activation=False: the logits)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # a cross-encoder's pair prompt; a bi-encoder's two prompts, one after the other
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """What the front-end knows of a classification checkpoint's head."""
    num_labels: int
    activation: str
    labels: tuple[str | None, ...] = field(default=())  # id2label, by class index

    @classmethod
    def of(cls, hf_config) -> ClassifierHead | None:
        """The head of an `*ForSequenceClassification` checkpoint; None for any other model."""
        architectures = getattr(hf_config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            return None
        num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
        id2label = getattr(hf_config, "id2label", None) or {}
        labels = tuple(id2label.get(i, id2label.get(str(i))) for i in range(num_labels))
        return cls(num_labels, _activation(hf_config, num_labels), labels)

    @property
    def is_cross_encoder(self) -> bool:
        """vLLM scores pairs only with a one-label classifier (num_labels == 1)."""
        return self.num_labels == 1

    def probs(self, logits: Sequence[float], use_activation: bool | None = None) -> list[float]:
        if use_activation is False or self.activation == "identity":
            return list(logits)
        if self.activation == "sigmoid":
            return [_sigmoid(x) for x in logits]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]

    def label(self, probs: Sequence[float]) -> str | None:
        """The most probable class's name (vLLM's /classify `label`)."""
        best = max(range(len(probs)), key=probs.__getitem__)
        return self.labels[best] if best < len(self.labels) else None


# A classifier's pooling: the first token's logits as they are (model/models/bert_classifier.py).
CLASSIFIER_POOLING = PoolingParams(pooling_type="CLS", normalize=False)


def classifier_pooling(params: PoolingParams | None) -> PoolingParams:
    """A request's pooling for a classifier: only use_activation is the caller's (vLLM's classify params)."""
    if params is not None and (params.dimensions is not None or params.normalize
                               or params.pooling_type not in (None, "CLS")):
        raise ValueError("A classifier pools its first token's class logits: dimensions, normalize and pooling_type "
                         "do not apply (use_activation does).")
    return PoolingParams("CLS", False, use_activation=None if params is None else params.use_activation)


def pair_up(left: list, right: list, name_1: str = "data_1", name_2: str = "data_2") -> list[tuple]:
    """vLLM's score pairing: 1 -> 1, 1 -> N (the one repeated), or N -> N pairwise."""
    if not left or not right:
        raise ValueError(f"{name_1 if not left else name_2} is empty; give at least one text.")
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise ValueError(f"{name_1} has {len(left)} texts and {name_2} {len(right)}: scores pair them 1:1, 1:N or N:N.")
    return list(zip(left, right))


def pair_token_ids(tokenizer, text_1: str, text_2: str) -> list[int]:
    """A text pair as a cross-encoder reads it: the tokenizer's pair encoding (BERT's `[CLS] a [SEP] b [SEP]`)."""
    return list(tokenizer(text_1, text_2)["input_ids"])


def check_pair_segments(hf_config) -> None:
    """A cross-encoder with segment embeddings tells a pair's texts apart by the [SEP] between them, so its config
    must name that id (model/models/bert_classifier.py): a clear error rather than scores of unsegmented pairs."""
    if getattr(hf_config, "type_vocab_size", 1) >= 2 and getattr(hf_config, "sep_token_id", None) is None:
        raise ValueError("This cross-encoder's config.json names no sep_token_id, which pressroom needs to give a "
                         "pair's second text its segment: start it with hf_overrides={'sep_token_id': N} (N: the "
                         "tokenizer's sep_token_id; --hf-overrides on the server).")


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def _activation(hf_config, num_labels: int) -> str:
    """vLLM's choice (its get_act_fn): problem_type first, then a cross-encoder's configured activation, then
    sigmoid for one label and softmax for more."""
    problem = getattr(hf_config, "problem_type", None) or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        st = getattr(hf_config, "sentence_transformers", None)
        name = st.get("activation_fn") if isinstance(st, dict) else None
        name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if name is not None:
            if name not in _ST_ACTIVATIONS:
                raise ValueError(f"The checkpoint's cross-encoder activation {name!r} is not supported; pressroom "
                                 f"knows {', '.join(_ST_ACTIVATIONS)}.")
            return _ST_ACTIVATIONS[name]
    return "sigmoid" if num_labels < 2 else "softmax"


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
