"""What every tool-call parser shares: a stream fed an output's text deltas, which reports content and
OpenAI-shaped tool-call deltas, and `extract`, the same stream fed the whole text at once.

A parser holds text back only while it cannot yet tell content from a call, and reports a call once its JSON
is complete and valid, so any chunking of an output gives the same content and calls as the whole output
(the streamed deltas reassemble to the non-streamed message). JSON that turns out malformed is content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pressroom.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolDelta:
    """What one fed delta (or the end of the output) adds: content text and tool-call deltas, in order
    (content before the calls it precedes)."""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(slots=True)
class Extraction:
    """A whole output: its content (None when it was all calls, or empty) and its calls."""
    content: str | None
    calls: list[ToolCall]


class ToolCallStream:
    """One output's parser state. Subclasses implement `_feed` and `_finish`, reporting through `add_content`,
    `add_call` (a whole call) or `begin_call` + `add_arguments` (a call whose arguments come in fragments).

    Trailing whitespace of the content is held until more content follows, and dropped at the end of an
    output with calls: whitespace around calls is not content, and holding it keeps the streamed content
    equal to the whole output's."""

    MARKERS: ClassVar[tuple[str, ...]] = ()  # the literal strings the format matches (its tags)

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return cls.MARKERS

    @classmethod
    def for_request(cls, parallel: bool, tools: list[Any]) -> ToolCallStream:
        """A parser for one request with these `tools` (a format that types arguments by the tools' schemas reads
        them; the others need only `parallel`)."""
        return cls(parallel)

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel  # False: the first call only (OpenAI's parallel_tool_calls)
        self.calls_begun = 0
        self._blank = ""  # the content's trailing whitespace, held
        self._out = ToolDelta()

    def feed(self, delta: str) -> ToolDelta:
        self._feed(delta)
        return self._take()

    def finish(self) -> ToolDelta:
        """The output ended: what was held back is settled (a call that never completed is content)."""
        self._finish()
        if self._blank and not self.calls_begun:
            self._out.content += self._blank
        self._blank = ""
        return self._take()

    def _feed(self, delta: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    # ---- what the parser reports ----

    def add_content(self, text: str) -> None:
        text = self._blank + text
        kept = text.rstrip()
        self._out.content += kept
        self._blank = text[len(kept):]

    def add_call(self, name: str, arguments: str) -> None:
        self.begin_call(name)
        self.add_arguments(arguments)

    def begin_call(self, name: str) -> None:
        self.calls_begun += 1
        if self._keeps_current():
            head = DeltaFunctionCall(name=name, arguments="")
            self._out.calls.append(DeltaToolCall(index=self.calls_begun - 1, id=call_id(), type="function",
                                                 function=head))

    def add_arguments(self, fragment: str) -> None:
        if fragment and self._keeps_current():
            self._out.calls.append(DeltaToolCall(index=self.calls_begun - 1,
                                                 function=DeltaFunctionCall(arguments=fragment)))

    def _keeps_current(self) -> bool:
        return self.parallel or self.calls_begun == 1

    def _take(self) -> ToolDelta:
        out, self._out = self._out, ToolDelta()
        return out


def extract(stream: ToolCallStream, text: str) -> Extraction:
    """A whole output's content and calls: `stream` fed `text` at once, its deltas assembled."""
    deltas = [stream.feed(text), stream.finish()]
    content = "".join(d.content for d in deltas)
    return Extraction(content or None, assemble([c for d in deltas for c in d.calls]))


def assemble(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """Whole calls from their streamed deltas (what a client does with them)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(id=d.id, function=FunctionCall(name=d.function.name, arguments=""))
        calls[d.index].function.arguments += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def function_call(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, or None when it is not one: an object with a
    string `name` and its arguments object under one of `argument_keys` (absent: no arguments)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (held back: it may be the
    start of the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def markers_are_special(tokenizer, markers: tuple[str, ...]) -> bool:
    """Whether any marker is one of the tokenizer's special tokens: decoded with skip_special_tokens, such a
    marker vanishes from the text and the parser never sees the call."""
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    return any(marker in special for marker in markers)
