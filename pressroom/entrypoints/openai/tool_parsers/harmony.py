"""OpenAI's harmony format (gpt-oss) read from the output's text, and `openai`, its tool-call parser.

A harmony output is a run of messages, each `<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT]
[ CONTENT_TYPE]<|message|>BODY` ended by `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the final answer);
the first message's `<|start|>assistant` is the generation prompt's, and a stop token ends the output without its
text. Channels: `analysis` (reasoning), `commentary` (tool calls, which name their recipient `functions.NAME`, and
preambles to the user), `final` (the answer). This is what openai-harmony's renderer writes and its parser reads
(token by token); here the same grammar is read from text, so it works on any chunking of the decoded output and
needs no vocabulary file.

`HarmonySplitter` turns text deltas into message events; the `openai_gptoss` reasoning parser (reasoning.py) and
`OpenAIToolStream` both read them. The reasoning parser passes tool-call messages on as canonical harmony text,
so `--reasoning-parser openai_gptoss --tool-call-parser openai` see the calls the same way as the tool parser
alone on the raw output.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\s*to=(\S+?)(?=\s|<\||$)")


@dataclass(frozen=True, slots=True)
class Header:
    role: str = "assistant"
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @classmethod
    def parse(cls, text: str) -> Header:
        """A header's text, between the message's start (or the output's start) and `<|message|>`."""
        text = text.removeprefix(START)
        role_part, _, channel_part = text.partition(CHANNEL)
        recipient = None
        found = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
        if found is not None:
            recipient = found.group(1)
            role_part = _RECIPIENT.sub("", role_part, count=1)
            channel_part = _RECIPIENT.sub("", channel_part, count=1)
        channel, _, content_type = channel_part.strip().partition(" ")
        return cls(role_part.strip() or "assistant", channel or None, recipient, content_type.strip() or None)

    def text(self) -> str:
        """The header as harmony writes it, `<|start|>` to `<|message|>` included."""
        to = f" to={self.recipient}" if self.recipient else ""
        content_type = f" {self.content_type}" if self.content_type else ""
        return f"{START}{self.role}{to}{CHANNEL}{self.channel or ''}{content_type}{MESSAGE}"


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "open" (a message's header came), "body" (its text), "close" (it ended), "text" (outside any)
    header: Header | None = None
    text: str = ""  # the body text, the terminator of a close ("" when the output or a new header ended it)


_HEADER_STARTS = (START, CHANNEL)
_BODY_ENDS = (*TERMINATORS, START, CHANNEL)


class HarmonySplitter:
    """Harmony text in, message events out; any chunking of the text gives the same events (bodies may come in
    more pieces). Text that is in no message (an output that starts without a header) is a "text" event."""

    def __init__(self) -> None:
        self._pending = ""
        self._header: Header | None = None  # the open message's
        self._in_header = False  # between a header's start and its <|message|>
        self._fresh = True  # at the start of the output or after a message: a header may come

    def feed(self, delta: str) -> list[Event]:
        text, self._pending = self._pending + delta, ""
        events: list[Event] = []
        while text:
            text = self._step(text, events)
        return events

    def finish(self) -> list[Event]:
        text, self._pending = self._pending, ""
        events: list[Event] = []
        if self._in_header or self._header is None:
            if text:
                events.append(Event("text", text=text))  # a cut header is no message
        else:
            if text:
                events.append(Event("body", self._header, text))
            events.append(Event("close", self._header))
        self._header, self._in_header = None, False
        return events

    def _step(self, text: str, events: list[Event]) -> str:
        if self._in_header:
            at = text.find(MESSAGE)
            if at < 0:
                self._pending = text
                return ""
            self._header, self._in_header = Header.parse(text[:at]), False
            events.append(Event("open", self._header))
            return text[at + len(MESSAGE):]
        if self._fresh:
            if text.startswith(_HEADER_STARTS) or text.startswith(" to="):  # " to=": right after the prompt's role
                self._in_header, self._fresh = True, False
                return text
            if any(m.startswith(text) for m in (*_HEADER_STARTS, " to=")):
                self._pending = text  # may still be a header's start
                return ""
            self._fresh = False
        return self._body(text, events)

    def _body(self, text: str, events: list[Event]) -> str:
        found = [(text.find(m), m) for m in _BODY_ENDS]
        at, marker = min(((a, m) for a, m in found if a >= 0), default=(-1, ""))
        kind = "text" if self._header is None else "body"
        if at < 0:
            keep = max(partial_suffix(text, m) for m in _BODY_ENDS)
            if text[:len(text) - keep]:
                events.append(Event(kind, self._header, text[:len(text) - keep]))
            self._pending = text[len(text) - keep:]
            return ""
        if at:
            events.append(Event(kind, self._header, text[:at]))
        if self._header is not None:
            events.append(Event("close", self._header, marker if marker in TERMINATORS else ""))
        self._header, self._fresh = None, True
        return text[at + len(marker):] if marker in TERMINATORS else text[at:]


class OpenAIToolStream(ToolCallStream):
    """`openai`: gpt-oss's calls, commentary messages to `functions.NAME` whose body is the arguments' JSON.
    Final and preamble messages (and text outside any message) are content; analysis messages and messages to
    built-in tools (`browser.*`, `python`) are neither, as in vLLM. A call's arguments that are not a JSON object
    make its body content."""
    MARKERS = MARKERS

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._split = HarmonySplitter()
        self._body: list[str] = []

    def _feed(self, delta: str) -> None:
        for event in self._split.feed(delta):
            self._on(event)

    def _finish(self) -> None:
        for event in self._split.finish():
            self._on(event)

    def _on(self, event: Event) -> None:
        header = event.header
        if event.kind == "text":
            self.add_content(event.text)
        elif header is None or event.kind == "open":
            return
        elif _is_call(header):
            if event.kind == "body":
                self._body.append(event.text)
            else:
                self._settle_call(header.recipient[len(FUNCTIONS):], "".join(self._body))
                self._body = []
        elif event.kind == "body" and header.channel != "analysis" and header.recipient is None:
            self.add_content(event.text)

    def _settle_call(self, name: str, body: str) -> None:
        try:
            arguments = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError:
            arguments = None
        if isinstance(arguments, dict) and name:
            self.add_call(name, json.dumps(arguments, ensure_ascii=False))
        else:
            self.add_content(body)


def _is_call(header: Header) -> bool:
    return header.recipient is not None and header.recipient.startswith(FUNCTIONS)
