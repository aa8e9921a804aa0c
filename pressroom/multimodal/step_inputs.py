"""A step's multimodal inputs, made by the model runner before its forward pass: the images the step's tokens
reach are encoded (or read from the encoder cache), their rows written over the placeholder tokens' embeddings,
and, for an M-RoPE model, the [3, tokens] positions built from each request's prompt rows.

A chunk may start or end inside a placeholder run: it takes the rows of the run it covers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pressroom.multimodal.encoder_cache import EncoderCache
from pressroom.multimodal.inputs import MediaItem, MediaRows, media_overlapping


@dataclass(slots=True)
class MediaRequest:
    """What the runner keeps of a request with media: its items, the ones it still needs pinned in the cache,
    and its M-RoPE rows over the prompt with the offset its later positions take."""
    items: list[MediaItem]
    pinned: list[str] = field(default_factory=list)
    mrope: np.ndarray | None = None  # [3, prompt tokens]
    mrope_delta: int = 0


@dataclass(slots=True)
class StepSpan:
    """One request's tokens in the step: positions [start, start + count) at flat rows [flat, flat + count)."""
    req_id: str
    start: int
    count: int
    flat: int


class MultimodalInputs:
    """The runner's side of multimodal models: requests' media, the encoder cache, each step's inputs."""

    def __init__(self, model: Any, cache_rows: int) -> None:
        self.model = model
        # a model whose media rows are large (Whisper's: a clip's whole encoder output in one row) caps them itself
        self.cache = EncoderCache(getattr(model, "max_cached_media_rows", cache_rows))
        self.requests: dict[str, MediaRequest] = {}
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # a step's missing items -> their rows, in one call: the model's tower, or its CUDA graphs once captured
        self.encode = model.encode_media

    def start(self, req_id: str, num_prompt_tokens: int, items: list[MediaItem] | None) -> None:
        self.finish(req_id)  # a preempted request starts over
        if not items:
            return
        state = MediaRequest(list(items))
        for item in items:
            self.cache.pin(item.hash)
            state.pinned.append(item.hash)
        if self.uses_mrope:
            state.mrope, state.mrope_delta = self.model.mrope_positions(num_prompt_tokens, items)
        self.requests[req_id] = state

    def finish(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            for key in state.pinned:
                self.cache.unpin(key)

    def step_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[StepSpan]
                    ) -> tuple[MediaRows | None, torch.Tensor]:
        """The step's media rows and where they go (None: no token of the step is a placeholder) and its
        positions ([3, tokens] for an M-RoPE model where a request with media is in the step)."""
        mine = [(s, self.requests[s.req_id]) for s in spans if s.req_id in self.requests]
        if not mine:
            return None, positions
        media = self._media_rows(input_ids.device, mine)
        if self.uses_mrope:
            positions = self._mrope_positions(positions, spans, input_ids.device)
        for span, state in mine:
            self._unpin_passed(span, state)
        return media, positions

    def _media_rows(self, device, mine: list[tuple[StepSpan, MediaRequest]]) -> MediaRows | None:
        reached = [(span, item) for span, state in mine
                   for item in media_overlapping(state.items, span.start, span.start + span.count)]
        if not reached:
            return None
        self._encode_missing([item for _, item in reached])
        rows, targets = [], []
        for span, item in reached:
            lo, hi = max(item.offset, span.start), min(item.end, span.start + span.count)
            rows.append(self.cache.get(item.hash)[lo - item.offset:hi - item.offset])
            first = span.flat + lo - span.start
            targets.append(torch.arange(first, first + hi - lo))
        return MediaRows(torch.cat(targets).to(device), torch.cat(rows))

    def _encode_missing(self, items: list[MediaItem]) -> None:
        missing = list({m.hash: m for m in items if m.hash not in self.cache}.values())
        if missing:
            for item, rows in zip(missing, self.encode(missing)):
                self.cache.put(item.hash, rows)

    def _mrope_positions(self, positions: torch.Tensor, spans: list[StepSpan], device) -> torch.Tensor:
        """Each request's three position rows: a prompt with media reads its M-RoPE rows and later tokens add its
        offset; a text-only request's rows are its positions."""
        out = np.empty((3, positions.shape[-1]), dtype=np.int64)
        for span in spans:
            pos = np.arange(span.start, span.start + span.count)
            state = self.requests.get(span.req_id)
            rows = out[:, span.flat:span.flat + span.count]
            if state is None or state.mrope is None:
                rows[:] = pos
                continue
            prompt_len = state.mrope.shape[1]
            in_prompt = pos < prompt_len
            rows[:, in_prompt] = state.mrope[:, pos[in_prompt]]
            rows[:, ~in_prompt] = pos[~in_prompt] + state.mrope_delta
        if (out[0] == out[1]).all() and (out[0] == out[2]).all():
            # text positions only (decodes, text after the images): M-RoPE's three equal rows are plain RoPE, and
            # one row lets the step replay a decode CUDA graph
            return torch.from_numpy(out[0].copy()).to(device)
        return torch.from_numpy(out).to(device)

    def _unpin_passed(self, span: StepSpan, state: MediaRequest) -> None:
        """Items whose runs the request has now computed no longer need their rows kept for it."""
        done = span.start + span.count
        for item in state.items:
            if item.end <= done and item.hash in state.pinned:
                state.pinned.remove(item.hash)
                self.cache.unpin(item.hash)
