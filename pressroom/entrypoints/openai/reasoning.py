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

The DeepSeek parsers (vLLM's names) differ only in how the span opens and ends (`SpanRules`):
- `deepseek_r1`: R1's template opens `<think>` in the generation prompt (older ones let the model write it), so
  the output always starts inside the span; a leading `<think>` is skipped.
- `deepseek_v3`: V3.1's template ends the generation prompt with `<think>` (thinking on) or `</think>` (off); the
  prompt alone says which, and an output of a prompt that did not open the span has no span.
- `deepseek_v4`: as V3.1, and a DSML tool-call block ends the span too (V4 may call tools right after thinking,
  without `</think>`); the block is content, for the tool-call parser.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pressroom.entrypoints.openai.tool_parsers.deepseek import V4_BLOCK


@dataclass(frozen=True, slots=True)
class SpanRules:
    """How a parser's span opens and ends, beyond its start and end markers."""
    always_open: bool = False  # the output starts inside the span whatever the prompt; a leading start is skipped
    output_may_open: bool = True  # after a prompt that leaves the span closed, the output may open it itself
    content_starts: tuple[str, ...] = ()  # markers that end the span and begin the content (kept in it)


RULES = {
    "think": SpanRules(),
    "deepseek_r1": SpanRules(always_open=True),
    "deepseek_v3": SpanRules(output_may_open=False),
    "deepseek_v4": SpanRules(output_may_open=False, content_starts=(V4_BLOCK.open,)),
}
PARSERS = tuple(RULES)


@dataclass(slots=True)
class _SplitState:
    in_reasoning: bool
    may_open: bool  # at the very start of the output: a start marker may still come
    pending: str = ""
    seen_span: bool = False
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)


class ReasoningParser:
    """`<think>...</think>` (start and end strings configurable), the span opening and ending by `rules`."""

    def __init__(self, tokenizer, start: str = "<think>", end: str = "</think>",
                 rules: SpanRules = RULES["think"]) -> None:
        if not start or not end:
            raise ValueError("The reasoning markers must be non-empty strings.")
        self.start, self.end, self.rules = start, end, rules
        self.start_ids = self._ids(tokenizer, start)
        self.end_ids = self._ids(tokenizer, end)
        self.content_start_ids = [self._ids(tokenizer, marker) for marker in rules.content_starts]
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
        if self.rules.always_open:
            return True
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
            if not self.rules.output_may_open or output_ids[:len(self.start_ids)] != self.start_ids:
                return 0
            start = len(self.start_ids)
        ends = [_end_of_first(output_ids, self.end_ids, start)]
        ends += [_start_of_first(output_ids, ids, start) for ids in self.content_start_ids]
        return min((e for e in ends if e >= 0), default=len(output_ids))


class ReasoningStream:
    """Feeds text deltas of one output; each `feed` returns (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser, prompt_opens: bool) -> None:
        self.parser = parser
        rules = parser.rules
        # an always-open span may still begin with its start marker: skipped like an opening one
        may_open = rules.always_open or (not prompt_opens and rules.output_may_open)
        self.state = _SplitState(in_reasoning=prompt_opens, may_open=may_open, seen_span=prompt_opens)

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
            at, marker = _first_span_end(text, p)
            if at >= 0:
                reasoning.append(text[:at])
                st.in_reasoning = False
                # the end marker is dropped; a content start is the content's beginning
                content.append(text[at + len(marker):] if marker == p.end else text[at:])
            else:
                keep = max(_partial_suffix(text, m) for m in (p.end, *p.rules.content_starts))
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
    """`--reasoning-parser`: one of PARSERS, "none", or None/"auto" (think when the model has the markers)."""
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
    return ReasoningParser(tokenizer, start, end, RULES[name])


def _first_span_end(text: str, parser: ReasoningParser) -> tuple[int, str]:
    """(where, which) of the earliest marker in `text` that ends the span: the end marker or a content start."""
    found = [(text.find(m), m) for m in (parser.end, *parser.rules.content_starts)]
    return min(((at, m) for at, m in found if at >= 0), default=(-1, ""))


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
    at = _start_of_first(ids, seq, start)
    return at + len(seq) if at >= 0 else -1


def _start_of_first(ids: list[int], seq: list[int], start: int) -> int:
    n = len(seq)
    for i in range(start, len(ids) - n + 1):
        if ids[i:i + n] == seq:
            return i
    return -1
