"""What the marker-delimited formats share: content up to a call region's opening marker, the region's text up to
its closing marker (or, for formats without one, up to the next opening or the end of the output), read as calls
by the format's `parse`. A region that does not parse is content, markers included; an output that ends inside a
region has that region parsed as it is (a model stopped by its end-of-turn token often never writes the closing).

Calls may carry the id the model wrote (Mistral's `[CALL_ID]`, Kimi-K2's `functions.NAME:N`): it becomes the call's
id, as the model's own template writes it back in the next turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pressroom.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream, call_id, partial_suffix


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # a JSON object's text
    id: str | None = None  # the model's own id, when the format has one


class IdentifiedCallStream(ToolCallStream):
    """A stream whose calls may come with the model's ids (else one is made, `make_id`)."""

    @staticmethod
    def make_id() -> str:
        return call_id()

    def add_identified(self, call: Call) -> None:
        self.calls_begun += 1
        if not self._keeps_current():
            return
        head = DeltaFunctionCall(name=call.name, arguments="")
        self._out.calls.append(DeltaToolCall(index=self.calls_begun - 1, id=call.id or self.make_id(),
                                             type="function", function=head))
        self.add_arguments(call.arguments)


class MarkedCallStream(IdentifiedCallStream):
    """OPENS: the markers that open a region (the first listed is the canonical one); CLOSE: the marker that ends
    it, or None when a region runs to the next opening or to the end of the output."""
    OPENS: ClassVar[tuple[str, ...]]
    CLOSE: ClassVar[str | None] = None

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return cls.OPENS + ((cls.CLOSE,) if cls.CLOSE else ())

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pending = ""  # text that may be the start of a marker, or the body of the open region
        self._open: str | None = None  # the marker that opened the current region

    def parse(self, body: str) -> list[Call] | None:
        """The calls of one region's text (between its markers), or None if it is not calls."""
        raise NotImplementedError

    def _feed(self, delta: str) -> None:
        text, self._pending = self._pending + delta, ""
        while text:
            text = self._region_part(text) if self._open is not None else self._content_part(text)

    def _content_part(self, text: str) -> str:
        at, marker = _first_of(text, self.OPENS)
        if at < 0:
            keep = max(partial_suffix(text, m) for m in self.OPENS)
            self.add_content(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return ""
        self.add_content(text[:at])
        self._open = marker
        return text[at + len(marker):]

    def _region_part(self, text: str) -> str:
        ends = (self.CLOSE,) if self.CLOSE else self.OPENS
        at, marker = _first_of(text, ends)
        if at < 0:
            self._pending = text
            return ""
        self._settle(text[:at], closed=bool(self.CLOSE))
        # without a closing marker the next opening begins the next region: leave it to _content_part
        return text[at + len(marker):] if self.CLOSE else text[at:]

    def _finish(self) -> None:
        text, self._pending = self._pending, ""
        if self._open is None:
            self.add_content(text)
        else:
            self._settle(text, closed=False)

    def _settle(self, body: str, closed: bool) -> None:
        opened, self._open = self._open, None
        calls = self.parse(body)
        if calls is None:
            self.add_content(opened + body + (self.CLOSE if closed and self.CLOSE else ""))
            return
        for call in calls:
            self.add_identified(call)


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(text.find(m), m) for m in markers]
    return min(((at, m) for at, m in found if at >= 0), default=(-1, ""))


def json_object_text(value: Any) -> str | None:
    """Arguments as JSON text: a dict, or JSON text of an object (some models write the arguments as a string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_of(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """A decoded `{"name": ..., "arguments": {...}}` object as a Call (its "id" kept), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = "{}" if key is None else json_object_text(value[key])
    if arguments is None:
        return None
    identifier = value.get("id")
    return Call(value["name"], arguments, identifier if isinstance(identifier, str) and identifier else None)


def json_calls(text: str, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """The calls of a JSON array of call objects (or of one call object), or None if the text is not that."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_of(item, argument_keys) for item in items]
    return None if any(c is None for c in calls) else calls
