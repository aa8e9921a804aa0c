"""Incremental detokenization that never splits a multi-byte or multi-token character, plus stop strings."""
from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the first outputs, for tokenizers that strip leading spaces


def fast_decoder(tokenizer):
    """The Rust tokenizer's decode when there is one: much cheaper per call than the Python wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, decode, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop_strings: list[str] | None = None, include_stop_str: bool = False, min_tokens: int = 0) -> None:
        self.decode = decode
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        self.stop_strings = stop_strings or []
        self.include_stop = include_stop_str
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.stopped_by: str | None = None
        self.min_tokens = min_tokens
        self.num_tokens = 0

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if one now ends the text."""
        self.ids.append(token_id)
        self.num_tokens += 1
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the bytes that finish it
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(before)

    def _check_stop(self, before: int) -> str | None:
        if self.num_tokens <= self.min_tokens:
            return None  # stop strings wait for min_tokens, as stop tokens do
        for stop in self.stop_strings:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
                self.stopped_by = stop
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """Text safe to stream: withholds a tail that could still grow into a stop string."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
