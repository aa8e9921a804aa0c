"""Incremental detokenization that never splits a multi-byte or multi-token character, plus stop strings."""
from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the first outputs, for tokenizers that strip leading spaces


def fast_decoder(tokenizer):
    """The Rust tokenizer's decode when there is one: much cheaper per call than the Python wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


NO_STOP = sys.maxsize  # a node where no stop string ends


class StopStrings:
    """A request's stop strings as an Aho-Corasick automaton, built once and shared by its n samples.

    Each sample walks it one new character at a time from the node its text reached (StopStrings.walk), so
    checking a token costs the token's characters, whatever the number or length of the stop strings. The
    answer is the plain loop's: of the stop strings that end in the new text, the first in the list wins,
    cut at its earliest such occurrence."""

    __slots__ = ("strings", "longest", "_goto", "_fail", "_first")

    def __init__(self, strings: Sequence[str] = ()) -> None:
        self.strings = list(strings)
        self.longest = max(map(len, self.strings), default=0)
        self._goto: list[dict[str, int]] = [{}]  # node -> character -> node: the trie of the stop strings
        self._first = [NO_STOP]  # node -> lowest index of a stop string that is a suffix of the node's text
        for index, stop in enumerate(self.strings):
            self._insert(index, stop)
        self._fail = self._link()

    def __bool__(self) -> bool:
        return bool(self.strings)

    def _insert(self, index: int, stop: str) -> None:
        node = 0
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = self._goto[node][char] = len(self._goto)
                self._goto.append({})
                self._first.append(NO_STOP)
            node = child
        self._first[node] = min(self._first[node], index)

    def _link(self) -> list[int]:
        """Failure links (node -> node of its longest proper suffix in the trie), breadth first, folding each
        link's stop strings into `_first` as it goes (a shallower node is final before a deeper one reads it)."""
        goto, first = self._goto, self._first
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for char, child in goto[node].items():
                queue.append(child)
                suffix = fail[node]
                while suffix and char not in goto[suffix]:
                    suffix = fail[suffix]
                fail[child] = goto[suffix].get(char, 0)
                first[child] = min(first[child], first[fail[child]])
        return fail

    def walk(self, node: int, text: str) -> tuple[int, int, int]:
        """Feeds `text` from `node`. Returns the node reached, and the lowest index of a stop string ending
        within `text` with the end (an offset into `text`) of its first such occurrence: (node, NO_STOP, -1)
        when none ends there. The lowest index's first occurrence is the first offset where it is the lowest
        ending, since no lower one ends anywhere in `text`."""
        goto, fail, first = self._goto, self._fail, self._first
        best, best_end = NO_STOP, -1
        for offset, char in enumerate(text):
            while node and char not in goto[node]:
                node = fail[node]
            node = goto[node].get(char, 0)
            if first[node] < best:
                best, best_end = first[node], offset + 1
        return node, best, best_end


class IncrementalDetokenizer:
    def __init__(self, decode, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop_strings: StopStrings | Sequence[str] | None = None, include_stop_str: bool = False,
                 min_tokens: int = 0) -> None:
        self.decode = decode
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        # a request's samples share one automaton (LLMEngine builds it); a list is built here
        self.stops = stop_strings if isinstance(stop_strings, StopStrings) else StopStrings(stop_strings or ())
        self.stop_node = 0  # where the text so far left the automaton
        self.include_stop = include_stop_str
        self.holdback = max(self.stops.longest - 1, 0)
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
        """The stop string that ends in the text after `before`, cutting the text there; None if none does."""
        if not self.stops:
            return None
        self.stop_node, index, end = self.stops.walk(self.stop_node, self.text[before:])
        if index == NO_STOP or self.num_tokens <= self.min_tokens:
            return None  # stop strings wait for min_tokens, as stop tokens do
        stop = self.stops.strings[index]
        end += before
        self.text = self.text[:end] if self.include_stop else self.text[:end - len(stop)]
        self.stopped_by = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to stream: withholds a tail that could still grow into a stop string."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
