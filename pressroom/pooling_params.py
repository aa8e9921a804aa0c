"""Pooling parameters (vLLM's names): how a request's hidden states become one vector."""
from __future__ import annotations

from dataclasses import dataclass

# LAST: the last token's hidden state (decoders: it has seen the whole prompt); MEAN: the average over
# every prompt token (sentence-transformers' mean pooling); CLS: the first token's (BERT's [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(slots=True)
class PoolingParams:
    """None fields take the model's defaults (its pooler config; for sentence-transformers checkpoints, their
    Pooling and Normalize modules). `dimensions` keeps the first n dimensions (Matryoshka), normalised after.
    `use_activation` is vLLM 0.32's name for both activations: an embedding's normalisation (`normalize`, vLLM's
    older name, wins where set) and a classifier's softmax or sigmoid (False: the class logits; the front-end
    applies it, engine/classify.py)."""
    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}.")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")

    def resolved(self, default: PoolingParams) -> PoolingParams:
        """These params with every unset field taken from `default` (the model's)."""
        normalize = next((v for v in (self.normalize, self.use_activation, default.normalize) if v is not None), None)
        return PoolingParams(self.pooling_type or default.pooling_type, normalize, self.dimensions, self.use_activation)
