"""Reasoning parsers: split a reasoning model's `<think>...</think>` span from its answer.

Like vLLM's `--reasoning-parser`, the chat endpoint reports the span as `reasoning_content` and the rest
as `content`, streamed (delta.reasoning_content, then delta.content) or not, and counts reasoning tokens
in `usage.completion_tokens_details.reasoning_tokens`.

The split is done on the text, by one state machine fed chunk by chunk: a marker split across chunks
(or across tokens) is held back until it is whole or proven not to be one, so any chunking gives the
same result as the whole text at once (streamed concatenation == non-streamed). Whether the output
starts inside the span is read from the prompt's token ids (a chat template that opens `<think>` in the
generation prompt) or from the output beginning with the start marker.

Reasoning tokens are counted on token ids: generated tokens up to and including the end marker (all of
them while the span is still open).
"""
from __future__ import annotations

from dataclasses import dataclass, field

PARSERS = ("think",)


@dataclass(slots=True)
class _SplitState:
    in_reasoning: bool
    may_open: bool  # at the very start of the output: a start marker may still come
    pending: str = ""
    seen_span: bool = False
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)


class ReasoningParser:
    """`<think>...</think>` (start and end strings configurable)."""

    def __init__(self, tokenizer, start: str = "<think>", end: str = "</think>") -> None:
        if not start or not end:
            raise ValueError("The reasoning markers must be non-empty strings.")
        self.start, self.end = start, end
        self.start_ids = self._ids(tokenizer, start)
        self.end_ids = self._ids(tokenizer, end)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # Markers that are special tokens vanish from text decoded with skip_special_tokens; the server then
        # keeps special tokens in the text of requests it parses.
        self.markers_are_special = bool(special & set(self.start_ids + self.end_ids))

    @staticmethod
    def _ids(tokenizer, text: str) -> list[int]:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if token_id is not None and token_id != tokenizer.unk_token_id and token_id >= 0:
            return [token_id]
        return list(tokenizer.encode(text, add_special_tokens=False))

    @classmethod
    def applies_to(cls, tokenizer, start: str = "<think>", end: str = "</think>") -> bool:
        """True for a model whose chat template or vocabulary has the markers (the default parser's test)."""
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, str) and start in template and end in template:
            return True
        vocab_ids = [tokenizer.convert_tokens_to_ids(t) for t in (start, end)]
        return all(i is not None and i >= 0 and i != tokenizer.unk_token_id for i in vocab_ids)

    # ---- where the output starts ----

    def prompt_opens(self, prompt_ids: list[int]) -> bool:
        """The prompt ends inside an open thinking span (its last start marker has no end marker after it)."""
        opened = _end_of_last(prompt_ids, self.start_ids)
        return opened >= 0 and _end_of_last(prompt_ids, self.end_ids) < opened

    # ---- text ----

    def stream(self, prompt_opens: bool) -> ReasoningStream:
        return ReasoningStream(self, prompt_opens)

    def split(self, text: str, prompt_opens: bool) -> tuple[str | None, str]:
        """(reasoning_content or None when there was no span, content) of a whole output."""
        s = self.stream(prompt_opens)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning = r1 + r2
        return (reasoning if s.state.seen_span else None), c1 + c2

    # ---- tokens ----

    def count_reasoning_tokens(self, output_ids: list[int], prompt_opens: bool) -> int:
        """Generated tokens up to and including the end marker; all of them while the span is open."""
        start = 0
        if not prompt_opens:
            if output_ids[:len(self.start_ids)] != self.start_ids:
                return 0
            start = len(self.start_ids)
        end = _end_of_first(output_ids, self.end_ids, start)
        return len(output_ids) if end < 0 else end


class ReasoningStream:
    """Feeds text deltas of one output; each `feed` returns (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser, prompt_opens: bool) -> None:
        self.parser = parser
        self.state = _SplitState(in_reasoning=prompt_opens, may_open=not prompt_opens, seen_span=prompt_opens)

    def feed(self, delta: str) -> tuple[str, str]:
        st, p = self.state, self.parser
        text = st.pending + delta
        st.pending = ""
        reasoning, content = [], []
        if st.may_open:
            stripped = text.lstrip()
            if stripped.startswith(p.start):
                st.may_open, st.in_reasoning, st.seen_span = False, True, True
                text = stripped[len(p.start):]
            elif p.start.startswith(stripped):  # still could be the start marker (or only whitespace so far)
                st.pending = text
                return "", ""
            else:
                st.may_open = False
        if st.in_reasoning:
            at = text.find(p.end)
            if at >= 0:
                reasoning.append(text[:at])
                st.in_reasoning = False
                content.append(text[at + len(p.end):])
            else:
                keep = _partial_suffix(text, p.end)
                reasoning.append(text[:len(text) - keep])
                st.pending = text[len(text) - keep:]
        else:
            content.append(text)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flushes what was held back (the output ended: a partial marker is just text)."""
        st = self.state
        text, st.pending = st.pending, ""
        if st.in_reasoning:
            return text, ""
        return "", text

    @property
    def seen_span(self) -> bool:
        return self.state.seen_span


def make_parser(name: str | None, tokenizer, start: str = "<think>", end: str = "</think>") -> ReasoningParser | None:
    """`--reasoning-parser`: "think", "none", or None/"auto" (think when the model has the markers)."""
    if tokenizer is None:  # skip_tokenizer_init: token ids only, nothing to parse
        if name not in (None, "auto", "none"):
            raise ValueError("A reasoning parser needs the tokenizer; drop --skip-tokenizer-init.")
        return None
    if name in (None, "auto"):
        return ReasoningParser(tokenizer, start, end) if ReasoningParser.applies_to(tokenizer, start, end) else None
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose from {', '.join(PARSERS)}, auto or none.")
    return ReasoningParser(tokenizer, start, end)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _end_of_last(ids: list[int], seq: list[int]) -> int:
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == seq:
            return i + n
    return -1


def _end_of_first(ids: list[int], seq: list[int], start: int) -> int:
    n = len(seq)
    for i in range(start, len(ids) - n + 1):
        if ids[i:i + n] == seq:
            return i + n
    return -1
