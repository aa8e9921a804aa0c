"""BERT with a sequence-classification head (HF's BertForSequenceClassification: classifiers and cross-encoders).

The head (BERT's pooler, dense + tanh, then the classifier) runs on every token's state, so each row of the
output is that token's class logits; CLS pooling (the runner's, worker/pooler.py) then picks the first token's,
which is exactly HF's. A head over every token costs about one hidden x hidden product per token, under 1% of a
BERT-base forward, and needs nothing of the runner beyond pooling.

Segments (token type ids): a text pair arrives as one prompt, `[CLS] a [SEP] b [SEP]` (as the tokenizer encodes a
pair), and the tokens after its first [SEP] are segment 1, as the tokenizer's token_type_ids say. That needs the
[SEP] id: config.json's `sep_token_id` (hf_overrides can set it); without it every token is segment 0.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pressroom.attention.backend import get_attention_metadata
from pressroom.model.models.bert import BertModel, PaddedBatch

_HEAD_NAMES = {"pooler.dense.": "pooler_dense.", "classifier.": "classifier."}  # HF's (less `bert.`) -> ours


class BertForSequenceClassification(BertModel):
    def __init__(self, config) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.num_labels = config.num_labels
        self.sep_token_id = getattr(config, "sep_token_id", None)
        self.pooler_dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, config.num_labels)
        for p in (*self.pooler_dense.parameters(), *self.classifier.parameters()):
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's class logits, [tokens, num_labels]."""
        query_start_loc = get_attention_metadata().query_start_loc
        batch = PaddedBatch(query_start_loc, input_ids.device)
        segments = self._segments(input_ids, query_start_loc)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(segments))
        x = batch.sort(self.embed_norm(x))
        for layer in self.layers:
            x = layer(x, batch)
        hidden = batch.unsort(x)
        return self.classifier(torch.tanh(self.pooler_dense(hidden)))

    def _segments(self, input_ids: torch.Tensor, query_start_loc) -> torch.Tensor:
        """1 for each token after its sequence's first [SEP], else 0."""
        if self.sep_token_id is None or self.token_type_embeddings.num_embeddings < 2:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).to(torch.int32)
        before = sep.cumsum(0) - sep  # [SEP]s before each token, over the flat batch
        loc = np.asarray(query_start_loc)
        starts = torch.from_numpy(loc[:-1].astype(np.int64)).to(input_ids.device)
        lengths = torch.from_numpy(np.diff(loc).astype(np.int64)).to(input_ids.device)
        return (before - torch.repeat_interleave(before[starts], lengths) > 0).to(input_ids.dtype)

    # ---- the name map: BERT's, and the head's ----

    def skips(self, name: str) -> bool:
        bare = name.removeprefix("bert.")
        return not bare.startswith(tuple(_HEAD_NAMES)) and super().skips(name)

    def checkpoint_target(self, name: str) -> tuple[str, str | None]:
        bare = name.removeprefix("bert.")
        for theirs, ours in _HEAD_NAMES.items():
            if bare.startswith(theirs):
                return ours + bare.removeprefix(theirs), None
        return super().checkpoint_target(name)

    def checkpoint_parts(self, name: str) -> list[str]:
        for theirs, ours in _HEAD_NAMES.items():
            if name.startswith(ours):
                return [theirs + name.removeprefix(ours)]
        return super().checkpoint_parts(name)
