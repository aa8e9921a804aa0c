"""Reasoning parsers: split a reasoning model's `<think>...</think>` span from its answer.

Like vLLM's `--reasoning-parser`, the chat endpoint reports the span as `reasoning` (vLLM 0.32's name; its older
`reasoning_content` is taken on input only) and the rest as `content`, streamed (delta.reasoning, then
delta.content) or not, and counts reasoning tokens
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

Other vLLM names:
- `qwen3` (and `mimo`, which vLLM reads with Qwen3's parser): the think rules. Qwen3's template closes an empty
  span in the prompt when `enable_thinking` is false (no span), Qwen3-2507-Thinking's opens one (the output
  starts inside it), hybrid Qwen3 writes `<think>` itself. An output whose span never closes is all reasoning
  (vLLM's whole-output parser calls it content; its streaming one reasoning: streamed and whole agree here).
- `granite`: Granite 3.2's plain-text markers, "Here is my thought process:" ... "Here is my response:"
  ("Here's" too), at the start of the output (`GraniteReasoningParser`).
- `openai_gptoss` (vLLM's name; `gpt_oss` too): gpt-oss's harmony messages, the analysis channel as reasoning,
  final and preamble messages as content, tool calls passed on to the `openai` tool parser
  (`HarmonyReasoningParser`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pressroom.entrypoints.openai.tool_parsers import harmony
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
    "qwen3": SpanRules(),
    "mimo": SpanRules(),
}
HARMONY_NAMES = ("openai_gptoss", "gpt_oss")
PARSERS = (*RULES, "granite", *HARMONY_NAMES)


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
        """(reasoning or None when there was no span, content) of a whole output."""
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


def make_parser(name: str | None, tokenizer, start: str = "<think>", end: str = "</think>"
                ) -> ReasoningParser | GraniteReasoningParser | HarmonyReasoningParser | None:
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
    if name == "granite":
        return GraniteReasoningParser(tokenizer)
    if name in HARMONY_NAMES:
        return HarmonyReasoningParser(tokenizer)
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


# ---- granite: plain-text markers ----

_GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
_GRANITE_ENDS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser:
    """Granite 3.2's thinking (chat_template_kwargs thinking=True): the output opens with "Here is my thought
    process:" and the answer follows "Here is my response:" ("Here's" for either, as some quantized models write).
    The markers are plain text, so the span is found on text only; an output that does not open with the start
    phrase has no span."""

    start, end = _GRANITE_STARTS[0], _GRANITE_ENDS[0]
    markers_are_special = False

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # thinking_token_budget's markers: the phrases' tokens
        self.start_ids = list(tokenizer.encode(self.start, add_special_tokens=False))
        self.end_ids = list(tokenizer.encode(self.end, add_special_tokens=False))

    def prompt_opens(self, prompt_ids: list[int]) -> bool:
        return False  # the template never writes the start phrase for the model

    def stream(self, prompt_opens: bool) -> PhraseStream:
        return PhraseStream(_GRANITE_STARTS, _GRANITE_ENDS, prompt_opens)

    def split(self, text: str, prompt_opens: bool) -> tuple[str | None, str]:
        return _split_whole(self.stream(prompt_opens), text)

    def count_reasoning_tokens(self, output_ids: list[int], prompt_opens: bool) -> int:
        """Tokens up to the one that completes the end phrase (the shortest decoded prefix that holds it)."""
        text = self.tokenizer.decode(output_ids)
        if not prompt_opens and not text.lstrip().startswith(_GRANITE_STARTS):
            return 0
        if not any(e in text for e in _GRANITE_ENDS):
            return len(output_ids)
        low, high = 1, len(output_ids)
        while low < high:
            mid = (low + high) // 2
            if any(e in self.tokenizer.decode(output_ids[:mid]) for e in _GRANITE_ENDS):
                high = mid
            else:
                low = mid + 1
        return low


class PhraseStream:
    """A span opened by one of `starts` at the start of the output (or by the prompt) and ended by one of `ends`;
    both are dropped from the text. Same interface as ReasoningStream."""

    def __init__(self, starts: tuple[str, ...], ends: tuple[str, ...], prompt_opens: bool) -> None:
        self.starts, self.ends = starts, ends
        self.state = _SplitState(in_reasoning=prompt_opens, may_open=not prompt_opens, seen_span=prompt_opens)

    def feed(self, delta: str) -> tuple[str, str]:
        st = self.state
        text, st.pending = st.pending + delta, ""
        if st.may_open:
            stripped = text.lstrip()
            opened = next((m for m in self.starts if stripped.startswith(m)), None)
            if opened is not None:
                st.may_open, st.in_reasoning, st.seen_span = False, True, True
                text = stripped[len(opened):]
            elif any(m.startswith(stripped) for m in self.starts):
                st.pending = text
                return "", ""
            else:
                st.may_open = False
        if not st.in_reasoning:
            return "", text
        found = [(text.find(m), m) for m in self.ends]
        at, marker = min(((a, m) for a, m in found if a >= 0), default=(-1, ""))
        if at >= 0:
            st.in_reasoning = False
            return text[:at], text[at + len(marker):]
        keep = max(_partial_suffix(text, m) for m in self.ends)
        st.pending = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        st = self.state
        text, st.pending = st.pending, ""
        return (text, "") if st.in_reasoning else ("", text)

    @property
    def seen_span(self) -> bool:
        return self.state.seen_span


# ---- gpt-oss: harmony channels ----


class HarmonyReasoningParser:
    """gpt-oss: analysis-channel messages are reasoning; final and preamble (commentary without a recipient)
    messages are content, their headers dropped; a tool call (a message with a recipient) is passed on whole, as
    canonical harmony text, in the content, where the `openai` tool parser reads it. The channel tokens are
    special tokens of gpt-oss's vocabulary, kept in the text of requests this parser reads."""

    start, end = harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._marker_ids = {m: _single_id(tokenizer, m) for m in harmony.MARKERS}
        self.start_ids = [i for i in (self._marker_ids[harmony.CHANNEL],) if i is not None] \
            + list(tokenizer.encode("analysis", add_special_tokens=False)) \
            + [i for i in (self._marker_ids[harmony.MESSAGE],) if i is not None]
        self.end_ids = [self._marker_ids[harmony.END]] if self._marker_ids[harmony.END] is not None else []
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.markers_are_special = any(i in special for i in self._marker_ids.values() if i is not None)

    def prompt_opens(self, prompt_ids: list[int]) -> bool:
        return False  # a harmony output always begins with its message header

    def stream(self, prompt_opens: bool) -> HarmonyReasoningStream:
        return HarmonyReasoningStream()

    def split(self, text: str, prompt_opens: bool) -> tuple[str | None, str]:
        return _split_whole(self.stream(prompt_opens), text)

    def count_reasoning_tokens(self, output_ids: list[int], prompt_opens: bool) -> int:
        """The tokens of analysis messages, headers and terminators included (0 where the vocabulary lacks
        harmony's tokens)."""
        ids = self._marker_ids
        starts = {ids[harmony.START], ids[harmony.CHANNEL]} - {None}
        ends = {ids[m] for m in harmony.TERMINATORS} - {None}
        if ids[harmony.MESSAGE] is None or not starts:
            return 0
        count, begin, message_at = 0, 0, None
        for i, token in enumerate(output_ids):
            if message_at is None:  # in a header: its <|message|> ends it
                message_at = i if token == ids[harmony.MESSAGE] else None
            elif token in ends or token in starts:  # the body ends: at a terminator, or where a header starts
                stop = i + 1 if token in ends else i
                count += self._analysis_tokens(output_ids, begin, message_at, stop)
                begin, message_at = stop, None
        if message_at is not None:
            count += self._analysis_tokens(output_ids, begin, message_at, len(output_ids))
        return count

    def _analysis_tokens(self, ids: list[int], begin: int, message_at: int, stop: int) -> int:
        header = harmony.Header.parse(self.tokenizer.decode(ids[begin:message_at], skip_special_tokens=False))
        return stop - begin if header.channel == "analysis" else 0


class HarmonyReasoningStream:
    """Feeds harmony text deltas; each `feed` returns (reasoning delta, content delta)."""

    def __init__(self) -> None:
        self._split = harmony.HarmonySplitter()
        self._seen = False

    def feed(self, delta: str) -> tuple[str, str]:
        return self._route(self._split.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._route(self._split.finish())

    @property
    def seen_span(self) -> bool:
        return self._seen

    def _route(self, events: list[harmony.Event]) -> tuple[str, str]:
        reasoning, content = [], []
        for event in events:
            header = event.header
            if event.kind == "text":
                content.append(event.text)
            elif header is not None and header.recipient is not None:  # a tool call: passed on whole
                content.append(header.text() if event.kind == "open" else event.text)
            elif header is not None and header.channel == "analysis":
                self._seen = True
                reasoning.append(event.text if event.kind == "body" else "")
            elif event.kind == "body":
                content.append(event.text)
        return "".join(reasoning), "".join(content)


def _single_id(tokenizer, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id < 0 or token_id == tokenizer.unk_token_id:
        return None
    return token_id


def _split_whole(stream, text: str) -> tuple[str | None, str]:
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.seen_span else None), c1 + c2
